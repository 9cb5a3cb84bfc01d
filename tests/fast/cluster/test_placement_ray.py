"""Placement on a real multi-node Ray cluster (one machine, distinct loopback IPs, logical GPUs).

The head is 127.0.0.2, not 127.0.0.1: Ray rewrites a 127.0.0.1 bootstrap address to the host's
external IP, where a loopback-bound GCS cannot be reached.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import remove_placement_group

from miles.cluster.ordering import OrderingError
from miles.cluster.placement import (
    PlacementTimeout,
    create_gpu_placement_group,
    create_single_node_placement_group,
    ordered_bundles,
)
from miles.cluster.ray_setup import alive_nodes, connect, head_node_ip
from miles.contract.roles import plan_from_ips
from miles.runtime.layout import plan_layout

pytestmark = pytest.mark.slow

NODE_ARGS = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="ray-placement-", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    previous_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir  # Ray writes its current-cluster file there
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "num_gpus": 2, "node_ip_address": "127.0.0.2", "temp_dir": temp_dir},
    )
    cluster.add_node(**NODE_ARGS, num_gpus=2, node_ip_address="127.0.0.10")
    cluster.add_node(**NODE_ARGS, num_gpus=1, node_ip_address="127.0.0.3")
    cluster.wait_for_nodes()
    connect(cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if previous_tmpdir is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = previous_tmpdir


def locations(bundles) -> list[tuple[str, int]]:
    return [(b.node_ip, b.gpu_id) for b in bundles]


async def test_head_is_found_by_its_resource(cluster) -> None:
    assert head_node_ip() == "127.0.0.2"


async def test_lowest_ip_head_goes_last_and_trainers_take_the_first(cluster) -> None:
    pg = await create_gpu_placement_group(5, cpus_per_bundle=0, strategy="SPREAD", timeout_s=60)
    try:
        plan = plan_from_ips([n["NodeManagerAddress"] for n in alive_nodes()], head_node_ip(), 1)
        ordered = await ordered_bundles(pg, plan)
        # lowest-IP head last; 127.0.0.10 sorts after 127.0.0.3 (numeric, not text)
        assert locations(ordered) == [
            ("127.0.0.3", 0),
            ("127.0.0.10", 0),
            ("127.0.0.10", 1),
            ("127.0.0.2", 0),
            ("127.0.0.2", 1),
        ]
        layout = plan_layout(ordered, plan=plan, engines_per_node=1, tp_size=1)
        assert locations(layout.trainer) == [("127.0.0.3", 0)]
        assert [locations(e) for e in layout.engines] == [[("127.0.0.10", 0)], [("127.0.0.2", 0)]]
        # a plan that lacks a node the bundles landed on (another job's node) is refused
        with pytest.raises(OrderingError, match=r"127\.0\.0\.10"):
            await ordered_bundles(pg, plan_from_ips(["127.0.0.2", "127.0.0.3"], "127.0.0.2", 1))
    finally:
        remove_placement_group(pg)


async def test_single_node_group_stays_on_one_node(cluster) -> None:
    pg = await create_single_node_placement_group(2, cpus_per_bundle=0, timeout_s=60)
    try:
        ips = [n["NodeManagerAddress"] for n in alive_nodes()]
        ordered = await ordered_bundles(pg, plan_from_ips(ips, head_node_ip(), 1))
        assert len({b.node_ip for b in ordered}) == 1
        assert [b.gpu_id for b in ordered] == [0, 1]
    finally:
        remove_placement_group(pg)


async def test_an_unsatisfiable_group_fails_naming_the_node_that_lacks_gpus(cluster) -> None:
    # 5 GPUs in all; 3 nodes x 2 asked: 127.0.0.3 has one
    with pytest.raises(PlacementTimeout) as caught:
        await create_gpu_placement_group(6, cpus_per_bundle=0, timeout_s=3, name="too-big", nodes_expected=3)
    message = str(caught.value)
    assert "too-big not ready after 3 s" in message and "free resources hold 5" in message
    assert "node 127.0.0.3 holds 1 of its 2: GPU 1 available, 2 needed" in message
    assert "127.0.0.10" not in message and "GPU: gpus_per_node" in message
    states = {g["name"]: g["state"] for g in ray.util.placement_group_table().values()}
    assert states["too-big"] == "REMOVED"  # nothing stays pending behind the error


async def test_a_group_short_of_cpus_names_cpus_on_every_node(cluster) -> None:
    with pytest.raises(PlacementTimeout) as caught:
        await create_single_node_placement_group(2, cpus_per_bundle=1, timeout_s=2, name="no-cpus")
    message = str(caught.value)
    for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.10"):
        assert f"node {ip}" in message
    assert "CPU 1 available, 2 needed" in message and "ray.num_cpus" in message
    assert "node 127.0.0.2 (head)" in message
