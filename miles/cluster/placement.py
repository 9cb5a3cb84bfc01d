"""Placement groups of one bundle per GPU, and where each bundle landed (node IP, GPU id).

On CPU-only nodes the GPUs are logical (`ray start --num-gpus N`), which keeps the same code path.
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.ordering import BundleLocation, sort_bundles_by_plan
from miles.cluster.ray_setup import alive_nodes, head_node_ip
from miles.cluster.shortfall import NodeResources, describe_shortfall
from miles.contract.roles import RolePlan
from miles.errors import Category, MilesError

# Once every node has joined, a group that can be placed is placed within seconds; waiting longer only
# hides a job that asks for more than its nodes have.
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
# Each node offers `node:<ip>: 1`; this share per bundle pins a group to the node and leaves room for
# every bundle of the largest node (1000 GPUs).
NODE_PIN_SHARE = 0.001


class PlacementTimeout(MilesError, TimeoutError):
    """The placement group was not ready in time; the message says which node lacks what."""

    category = Category.CAPACITY


def node_resources() -> list[NodeResources]:
    """Each alive node's free resources (what `ray status` reads; Ray has no public per-node call)."""
    head = head_node_ip()
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # a Ray without it: the totals still show a node that is too small
        free = {}
    return [
        NodeResources(
            ip=node["NodeManagerAddress"],
            available=free.get(node["NodeID"], node.get("Resources", {})),
            is_head=node["NodeManagerAddress"] == head,
        )
        for node in alive_nodes()
    ]


@ray.remote(num_cpus=0, num_gpus=0.01)
class InfoActor:
    """Throw-away actor placed in one bundle to learn that bundle's node and GPU."""

    def where(self) -> tuple[str, int, str]:
        gpu_ids = ray.get_gpu_ids()
        ctx = ray.get_runtime_context()
        return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else -1, ctx.get_node_id()


def bundle_strategy(pg: PlacementGroup, bundle_index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True,
    )


async def create_gpu_placement_group(
    num_gpus: int,
    *,
    cpus_per_bundle: float = 1,
    strategy: str = "PACK",
    timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
    name: str = "",
    nodes_expected: int | None = None,
    node_ip: str | None = None,
    lifetime: str | None = None,
) -> PlacementGroup:
    """One `{"GPU": 1, "CPU": c}` bundle per GPU; waits until Ray has reserved them all.

    Not ready within `timeout_s`: PlacementTimeout naming the nodes that lack resources, judged against
    `nodes_expected` nodes each holding an equal share (STRICT_PACK: one node holding all).
    `node_ip`: every bundle on that node (a sliver of Ray's own `node:<ip>` resource pins it).
    `lifetime`: "detached" outlives the driver (whoever asks for it removes it at job end).
    """
    if num_gpus < 1:
        raise ValueError(f"a placement group needs at least one GPU, got {num_gpus}")
    bundle = {"GPU": 1, "CPU": cpus_per_bundle}
    if node_ip is not None:
        bundle[f"node:{node_ip}"] = NODE_PIN_SHARE
    pg = placement_group([bundle] * num_gpus, strategy=strategy, name=name, lifetime=lifetime)
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except TimeoutError:
        why = describe_shortfall(
            bundle,
            num_gpus,
            await asyncio.to_thread(node_resources),
            nodes_expected=nodes_expected,
            single_node=strategy == "STRICT_PACK",
        )
        remove_placement_group(pg)
        label = name or pg.id.hex()
        raise PlacementTimeout(f"placement group {label} not ready after {timeout_s:g} s: {why}") from None
    except asyncio.CancelledError:
        remove_placement_group(pg)
        raise
    except Exception as exc:
        remove_placement_group(pg)
        raise RuntimeError(f"placement group of {num_gpus} GPU bundles failed: {exc}") from exc
    return pg


async def create_single_node_placement_group(
    num_gpus: int,
    *,
    cpus_per_bundle: float = 1,
    timeout_s: float = 300,
    name: str = "",
    node_ip: str | None = None,
    lifetime: str | None = None,
) -> PlacementGroup:
    """All bundles on one node (STRICT_PACK), for one instance allocated on demand; on `node_ip` if set."""
    return await create_gpu_placement_group(
        num_gpus,
        cpus_per_bundle=cpus_per_bundle,
        strategy="STRICT_PACK",
        timeout_s=timeout_s,
        name=name,
        node_ip=node_ip,
        lifetime=lifetime,
    )


async def locate_bundles(pg: PlacementGroup) -> list[BundleLocation]:
    """Ask one InfoActor per bundle where it runs; the actors are killed afterwards."""
    strategies = [bundle_strategy(pg, i) for i in range(pg.bundle_count)]
    actors = [InfoActor.options(scheduling_strategy=s).remote() for s in strategies]
    try:
        answers = await asyncio.gather(*(actor.where.remote() for actor in actors))
    finally:
        for actor in actors:
            ray.kill(actor)
    return [
        BundleLocation(bundle_index=i, node_ip=ip, gpu_id=gpu, node_id=node_id)
        for i, (ip, gpu, node_id) in enumerate(answers)
    ]


async def ordered_bundles(pg: PlacementGroup, plan: RolePlan) -> list[BundleLocation]:
    """The group's bundles in the role plan's node order (head last), then by GPU id."""
    return sort_bundles_by_plan(await locate_bundles(pg), plan)
