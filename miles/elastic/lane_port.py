"""LoanExecutor's LanePort on Ray: a HybridLane actor on a lent engine's own placement-group bundle.

Ray places the actor only once the engine's actor has given the bundle's GPU back, so Ray's resource
accounting and the GPU ledger agree on the one owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.train.hybrid.coordinator import Lane
from miles.train.hybrid.lane import LANE_CONCURRENCY_GROUPS, HybridLane

RemoteLane = ray.remote(concurrency_groups=LANE_CONCURRENCY_GROUPS)(HybridLane)


class BundleLanePort:
    def __init__(
        self,
        pg: Any,
        bundles: Mapping[str, int],
        *,
        run: str,
        model_path: str,
        train_mode: str,
        backend_kwargs: Mapping[str, Any] | None = None,
        num_cpus: float = 1,
        group_timeout_s: float = 60.0,
        setup_timeout_s: float = 600.0,
    ) -> None:
        """`bundles`: engine name -> the bundle index its actor ran on (the first of its GPUs)."""
        self.pg, self.bundles = pg, dict(bundles)
        self.run, self.model_path, self.train_mode = run, model_path, train_mode
        self.backend_kwargs = dict(backend_kwargs or {})
        self.num_cpus, self.group_timeout_s, self.setup_timeout_s = num_cpus, group_timeout_s, setup_timeout_s

    async def start(self, engine: str) -> Lane:
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=self.bundles[engine]
        )
        name = f"lane-{engine}"
        actor = RemoteLane.options(num_cpus=self.num_cpus, num_gpus=1, scheduling_strategy=strategy).remote(
            name, group_timeout_s=self.group_timeout_s
        )
        try:
            setup = actor.setup.remote(self.run, self.model_path, self.train_mode, self.backend_kwargs)
            await asyncio.wait_for(setup, self.setup_timeout_s)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        return Lane(name, actor)

    async def stop(self, lane: Lane) -> None:
        ray.kill(lane.actor, no_restart=True)
