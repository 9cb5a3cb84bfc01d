"""Bundles in the order of the job's role plan (miles.contract.roles: numeric IP, the head last), then
GPU id."""

from __future__ import annotations

import pytest

from miles.cluster.ordering import BundleLocation, OrderingError, sort_bundles_by_plan
from miles.contract.roles import plan_from_ips


def b(index: int, ip: str, gpu: int) -> BundleLocation:
    return BundleLocation(bundle_index=index, node_ip=ip, gpu_id=gpu, node_id=ip)


def order(bundles: list[BundleLocation], head: str, train_nodes: int = 1) -> list[tuple[str, int]]:
    plan = plan_from_ips(sorted({x.node_ip for x in bundles}), head, train_nodes)
    return [(x.node_ip, x.gpu_id) for x in sort_bundles_by_plan(bundles, plan)]


def test_lowest_ip_head_goes_last_and_ips_sort_numerically() -> None:
    bundles = [b(0, "10.0.0.1", 1), b(1, "10.0.0.1", 0), b(2, "10.0.0.10", 0)]
    bundles += [b(3, "10.0.0.9", 1), b(4, "10.0.0.9", 0)]
    assert order(bundles, "10.0.0.1") == [
        ("10.0.0.9", 0),
        ("10.0.0.9", 1),
        ("10.0.0.10", 0),
        ("10.0.0.1", 0),
        ("10.0.0.1", 1),
    ]


def test_single_node_is_ordered_by_gpu_id() -> None:
    bundles = [b(0, "10.0.0.5", 3), b(1, "10.0.0.5", 0), b(2, "10.0.0.5", 2), b(3, "10.0.0.5", 1)]
    assert order(bundles, "10.0.0.5") == [("10.0.0.5", g) for g in range(4)]


def test_the_plan_decides_not_the_ips() -> None:
    """The driver follows the job's roles.tsv even where a fresh sort would differ."""
    plan = plan_from_ips(["10.0.0.2", "10.0.0.3"], "10.0.0.3", 1)
    reordered = type(plan)(plan.head, tuple(reversed(plan.ordered)))  # a plan written by someone else
    bundles = [b(0, "10.0.0.2", 0), b(1, "10.0.0.3", 0)]
    assert [x.node_ip for x in sort_bundles_by_plan(bundles, reordered)] == ["10.0.0.3", "10.0.0.2"]


def test_a_bundle_on_a_node_outside_the_plan_is_refused() -> None:
    plan = plan_from_ips(["10.0.0.2", "10.0.0.3"], "10.0.0.3", 1)
    with pytest.raises(OrderingError, match=r"10\.0\.0\.7, which the role plan does not list"):
        sort_bundles_by_plan([b(0, "10.0.0.2", 0), b(1, "10.0.0.7", 0)], plan)
