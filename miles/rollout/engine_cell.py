"""EngineCell: the driver's handle on one engine (its actor, its HTTP client, its lifecycle state).

The engine process and its Ray actor share their fate: the engine exits -> `EngineActor` ends its own
process (`os._exit`), so Ray reports the actor dead; the actor dies (ray.kill, node loss, crash) -> the
kernel kills the engine (`EngineProcess`'s parent-death signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.named import InstanceNames
from miles.cluster.ordering import BundleLocation
from miles.contract import events
from miles.engines.config import EngineConfig
from miles.engines.process import EngineProcess
from miles.engines.sglang_client import SGLangApiClient
from miles.observability.metrics import job_metrics
from miles.rollout.cell_state import SERVING_STATES, CellState, check_transition

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.25
_BUNDLE_RESOURCE = re.compile(r"^[A-Za-z]+_group_(\d+)_[0-9a-f]+$")


class EngineStartError(RuntimeError):
    pass


def _end_actor(returncode: int) -> None:
    logger.error("the engine exited with %s; ending its actor", returncode)
    os._exit(1)


class EngineHost:
    """The Ray actor's body: one `EngineProcess` on this node, whose unasked exit ends the actor."""

    def __init__(self, config: EngineConfig, visible_gpus: Sequence[int] = ()) -> None:
        host = ray.util.get_node_ip_address()
        self._visible_gpus = list(visible_gpus)
        self._engine = EngineProcess(config, host=host, visible_gpus=visible_gpus, on_exit=_end_actor)

    def start(self, log_path: str | None = None) -> str:
        return self._engine.start(log_path)

    def pid(self) -> int | None:
        return self._engine.pid()

    def url(self) -> str | None:
        """The engine's base URL (a restarted driver re-adopting this actor asks it)."""
        return self._engine.url

    def placement(self) -> tuple[int | None, list[int]]:
        """(its bundle index in its placement group, the GPUs its engine sees): what a driver re-adopting
        this actor needs to respawn the engine in the same place. Ray names a bundle's resources
        `<resource>_group_<index>_<group id>`."""
        assigned = ray.get_runtime_context().get_assigned_resources()
        indices = {int(m.group(1)) for name in assigned if (m := _BUNDLE_RESOURCE.match(name))}
        return (min(indices) if indices else None), list(self._visible_gpus)

    def stop(self) -> int | None:
        return self._engine.stop()


EngineActor = ray.remote(max_restarts=0)(EngineHost)


class EngineCell:
    """One engine. `bundle` is where its actor runs (the first of its GPUs' bundles); `gpu_ids` are the
    GPUs of all its bundles (one node), exported to the engine as CUDA_VISIBLE_DEVICES for TP > 1."""

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        bundle: tuple[PlacementGroup, int] | None = None,
        *,
        gpu_ids: Sequence[int] = (),
        names: InstanceNames | None = None,
        bundle_share: float = 1.0,
    ) -> None:
        if gpu_ids and len(gpu_ids) != config.gpus_per_engine:
            raise ValueError(
                f"engine {index} got GPUs {list(gpu_ids)} but gpus_per_engine is {config.gpus_per_engine}"
            )
        self.index = index
        self.config = config
        self.bundle = bundle
        self.gpu_ids = tuple(gpu_ids)
        self._state = CellState.NEW
        self._actor: Any = None
        self.client: SGLangApiClient | None = None
        self.problem: str | None = None
        self.starts = 0  # how many engine processes this cell has launched (1 + respawns)
        self._names = names  # actor named "engine-<index>" (a restarted driver re-adopts it)
        self.bundle_share = bundle_share  # of its bundle's GPU and CPUs: 0.5 when a trainer rank shares it

    # ----- state -----------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"engine cell {self.index}"

    @property
    def state(self) -> CellState:
        return self._state

    @property
    def serving(self) -> bool:
        return self._state in SERVING_STATES

    @property
    def actor(self) -> Any:
        """The engine's Ray actor (killing it kills the engine)."""
        return self._actor

    @property
    def gpus(self) -> int:
        return self.config.gpus_per_engine

    def transition(self, new: CellState) -> None:
        check_transition(self.name, self._state, new)
        logger.info("%s: %s -> %s", self.name, self._state.value, new.value)
        if self._state is CellState.FAILED and new is CellState.STARTING:
            job_metrics().engine_respawns.labels(str(self.index)).inc()
        detail = {"problem": self.problem} if new is CellState.FAILED else {}
        events.record("engine", engine=self.index, old=self._state.value, new=new.value, **detail)
        self._state = new
        job_metrics().set_engine_state(str(self.index), new.value)

    def mark_ready(self) -> None:
        self.transition(CellState.READY)

    def mark_pending(self) -> None:
        if self._state is CellState.READY:
            self.transition(CellState.PENDING_WEIGHTS)

    @property
    def released(self) -> bool:
        """Its engine gave its GPU memory back (colocated: miles.runtime.colocation moves it in and out)."""
        return self._state is CellState.RELEASED

    def kill(self, reason: str) -> None:
        """FAILED now, and its process ended (a respawn starts a new one on the same bundle)."""
        self.mark_failed(reason)
        self._kill_actor()

    def mark_failed(self, reason: str) -> None:
        if self._state not in (CellState.FAILED, CellState.STOPPED):
            self.problem = reason
            self.transition(CellState.FAILED)

    # ----- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine actor and process; returns once /health answers 200 (state PENDING_WEIGHTS)."""
        self.transition(CellState.STARTING)
        self.starts += 1
        try:
            cfg = self.config
            # a bundle holds one GPU: the actor takes its bundle's; the engine sees all of `gpu_ids`
            gpus = self.bundle_share if self.bundle is not None else cfg.gpus_per_engine
            cpus = cfg.num_cpus * self.bundle_share if self.bundle is not None else cfg.num_cpus
            options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus}
            if self.bundle is not None:
                pg, index = self.bundle
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                )
            if self._names is not None:
                role = f"engine-{self.index}"
                self._names.kill(role)  # a respawn: the dead one's name must be free
                options.update(self._names.actor_options(role))
            self._actor = EngineActor.options(**options).remote(self.config, visible_gpus=self.gpu_ids)
            log_path = f"{cfg.log_dir}/engine-{self.index}.log" if cfg.log_dir else None
            base_url = await self._actor.start.remote(log_path)
            self.client = SGLangApiClient(base_url, api_key=cfg.api_key, weight_api=cfg.weight_api)
            await self._wait_healthy()
        except BaseException as exc:
            self.mark_failed(f"start failed: {type(exc).__name__}: {exc}")
            self._kill_actor()
            raise
        self.problem = None
        self.transition(CellState.PENDING_WEIGHTS)

    async def adopt(self, actor: Any) -> None:
        """Take over an engine actor another driver started: PENDING_WEIGHTS once its engine answers
        /health (the caller decides when its weights are the trainer's and marks it ready)."""
        self.transition(CellState.STARTING)
        self.starts += 1
        self._actor = actor
        try:
            base_url = await asyncio.wait_for(actor.url.remote(), 30)
            if base_url is None:
                raise EngineStartError(f"{self.name}: the adopted actor runs no engine")
            self.client = SGLangApiClient(
                base_url, api_key=self.config.api_key, weight_api=self.config.weight_api
            )
            await self._wait_healthy()
        except BaseException as exc:
            self.mark_failed(f"adoption failed: {type(exc).__name__}: {exc}")
            self._kill_actor()
            raise
        self.transition(CellState.PENDING_WEIGHTS)

    async def _wait_healthy(self) -> None:
        assert self.client is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not await self.client.health(timeout_s=5):
            if time.monotonic() > deadline:
                waited = self.config.startup_timeout_s
                raise EngineStartError(f"{self.name}: {self.client.base_url} unhealthy after {waited:.0f} s")
            # an engine that died while loading takes its actor with it: fail now, not at the deadline
            await asyncio.wait_for(self._actor.pid.remote(), 30)
            await asyncio.sleep(HEALTH_POLL_S)

    async def restart(self) -> None:
        """Respawn on the same bundle after a failure."""
        self._kill_actor()
        await self.start()

    def _kill_actor(self) -> None:
        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    async def lend(self) -> None:
        """Stop the engine process and its actor (the bundle's GPUs are free for a hybrid lane); the cell
        stays LENT, never routed to or probed, until `start` brings it back (docs/elastic.md)."""
        actor = self._actor
        if actor is not None:
            await asyncio.wait_for(actor.stop.remote(), 15)
        self._kill_actor()
        self.client = None
        self.transition(CellState.LENT)

    async def stop(self) -> None:
        actor = self._actor
        if actor is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.stop.remote(), 15)
        self._kill_actor()
        if self._state is not CellState.STOPPED:
            self.transition(CellState.STOPPED)


def engine_cells_for(
    pg: PlacementGroup,
    engines: Sequence[Sequence[BundleLocation]],
    config: EngineConfig,
    names: InstanceNames | None = None,
    *,
    bundle_share: float = 1.0,
) -> list[EngineCell]:
    """One cell per engine of `plan_layout(...).engines`, in that (head-last) order."""
    return [
        EngineCell(
            i,
            config,
            (pg, group[0].bundle_index),
            gpu_ids=[b.gpu_id for b in group],
            names=names,
            bundle_share=bundle_share,
        )
        for i, group in enumerate(engines)
    ]
