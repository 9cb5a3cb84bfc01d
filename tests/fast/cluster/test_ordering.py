"""Pure bundle ordering (head last, numeric IP, GPU id) and the trainer/engine split."""

from __future__ import annotations

import pytest

from miles.cluster.ordering import BundleLocation, allocate_roles, ip_sort_key, sort_bundles_head_last


def b(index: int, ip: str, gpu: int) -> BundleLocation:
    return BundleLocation(bundle_index=index, node_ip=ip, gpu_id=gpu, node_id=ip)


def order(bundles: list[BundleLocation], head: str | None) -> list[tuple[str, int]]:
    return [(x.node_ip, x.gpu_id) for x in sort_bundles_head_last(bundles, head)]


def test_ips_sort_numerically_not_as_text() -> None:
    assert ip_sort_key("10.0.0.9") < ip_sort_key("10.0.0.10")
    assert ip_sort_key("10.0.0.10") < ip_sort_key("node-a")


def test_lowest_ip_head_goes_last() -> None:
    bundles = [b(0, "10.0.0.1", 1), b(1, "10.0.0.1", 0), b(2, "10.0.0.10", 0)]
    bundles += [b(3, "10.0.0.9", 1), b(4, "10.0.0.9", 0)]
    assert order(bundles, "10.0.0.1") == [
        ("10.0.0.9", 0),
        ("10.0.0.9", 1),
        ("10.0.0.10", 0),
        ("10.0.0.1", 0),
        ("10.0.0.1", 1),
    ]


def test_unknown_head_orders_by_ip_then_gpu() -> None:
    bundles = [b(0, "10.0.0.2", 0), b(1, "10.0.0.1", 1), b(2, "10.0.0.1", 0)]
    assert order(bundles, None) == [("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0)]
    assert order(bundles, "10.9.9.9") == order(bundles, None)


def test_single_node_is_ordered_by_gpu_id() -> None:
    bundles = [b(0, "10.0.0.5", 3), b(1, "10.0.0.5", 0), b(2, "10.0.0.5", 2), b(3, "10.0.0.5", 1)]
    assert order(bundles, "10.0.0.5") == [("10.0.0.5", g) for g in range(4)]


def test_trainers_first_engines_rest() -> None:
    ordered = sort_bundles_head_last([b(i, f"10.0.0.{1 + i // 2}", i % 2) for i in range(6)], "10.0.0.1")
    roles = allocate_roles(ordered, trainer_gpus=2, gpus_per_engine=2)
    assert [x.node_ip for x in roles.trainer] == ["10.0.0.2", "10.0.0.2"]
    assert [[x.node_ip for x in e] for e in roles.engines] == [["10.0.0.3"] * 2, ["10.0.0.1"] * 2]


def test_allocate_roles_refuses_bad_splits() -> None:
    ordered = [b(i, f"10.0.0.{1 + i // 2}", i % 2) for i in range(4)]
    with pytest.raises(ValueError, match="placement group has 4"):
        allocate_roles(ordered, trainer_gpus=5)
    with pytest.raises(ValueError, match="not a multiple"):
        allocate_roles(ordered, trainer_gpus=1, gpus_per_engine=2)
    with pytest.raises(ValueError, match="span nodes"):
        allocate_roles(ordered, trainer_gpus=1, gpus_per_engine=3)
