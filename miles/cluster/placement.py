"""Placement groups of one bundle per GPU, and where each bundle landed (node IP, GPU id).

On CPU-only nodes the GPUs are logical (`ray start --num-gpus N`), which keeps the same code path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.ordering import BundleLocation, sort_bundles_head_last
from miles.cluster.ray_setup import head_node_ip


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
    timeout_s: float = 300,
    name: str = "",
) -> PlacementGroup:
    """One `{"GPU": 1, "CPU": c}` bundle per GPU; waits until Ray has reserved them all."""
    if num_gpus < 1:
        raise ValueError(f"a placement group needs at least one GPU, got {num_gpus}")
    pg = placement_group([{"GPU": 1, "CPU": cpus_per_bundle}] * num_gpus, strategy=strategy, name=name)
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        remove_placement_group(pg)
        raise
    except Exception as exc:
        remove_placement_group(pg)
        raise RuntimeError(f"placement group of {num_gpus} GPU bundles failed: {exc}") from exc
    return pg


async def create_single_node_placement_group(
    num_gpus: int, *, cpus_per_bundle: float = 1, timeout_s: float = 300, name: str = ""
) -> PlacementGroup:
    """All bundles on one node (STRICT_PACK), for one instance allocated on demand."""
    return await create_gpu_placement_group(
        num_gpus, cpus_per_bundle=cpus_per_bundle, strategy="STRICT_PACK", timeout_s=timeout_s, name=name
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


async def ordered_bundles(pg: PlacementGroup, head_ip: str | None = None) -> list[BundleLocation]:
    """The group's bundles by (head last, node IP, GPU id); the head is looked up when not given."""
    locations = await locate_bundles(pg)
    return sort_bundles_head_last(locations, head_ip if head_ip is not None else head_node_ip())


def as_bundle_refs(pg: PlacementGroup, bundles: Sequence[BundleLocation]) -> list[tuple[PlacementGroup, int]]:
    """The `(placement group, bundle index)` pairs cells are started on."""
    return [(pg, b.bundle_index) for b in bundles]
