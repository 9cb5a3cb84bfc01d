"""InferenceController: owns the engine cells, routes only to weights-ready engines, and brackets every
weight update with ONE asyncio lock.

The bracket (`async with controller.weight_update() as update:`):
  enter  waits until no cell is STARTING (the lock is released between polls, so a respawn can finish),
         then, holding the lock, records whether health checks were running and pauses them, and moves
         the serving engines to PENDING_WEIGHTS (a half-updated engine must never serve);
  exit   on success marks those engines READY and records the version; on ANY exception or cancellation
         marks none ready, restores health checks as they were and releases the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from miles.engines.sglang_client import SGLangApiClient
from miles.errors import UnavailableError
from miles.observability.metrics import job_metrics
from miles.rollout.cell_state import CellState
from miles.rollout.health import HealthCheckConfig, HealthChecker
from miles.rollout.load import SamplingLoad

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.2
# Probed though not serving: FAILED (a failed respawn is retried) and RELEASED (a colocated engine that
# died while the trainer held the GPU is found then, not at the next switch to sampling).
PROBED_UNSERVING = frozenset({CellState.FAILED, CellState.RELEASED})

# Pushes the trainer's current weights (full or adapters) to every engine, inside `weight_update()`.
WeightRefresher = Callable[["InferenceController"], Awaitable[Any]]
RespawnGate = Callable[[], AbstractAsyncContextManager[Any]]


class NoEnginesError(RuntimeError):
    pass


class EngineLostError(UnavailableError):
    """A request reached an engine that then went away (process killed, connection reset)."""


@dataclass
class WeightUpdate:
    """One bracket: the engines it updates and the version a successful push sets."""

    engines: list[Any] = field(default_factory=list)
    version: int = 0
    holds_lock: bool = False
    paused_health: bool = False  # health checks were running and this update paused them
    finished: bool = False

    @property
    def clients(self) -> list[SGLangApiClient]:
        return [cell.client for cell in self.engines]


class InferenceController:
    def __init__(self, cells: Sequence[Any], *, health: HealthCheckConfig | None = None) -> None:
        self.cells = list(cells)
        self._lock = asyncio.Lock()
        self.weight_version = 0
        self._refresher: WeightRefresher | None = None
        self._respawn_gate: RespawnGate | None = None
        # LoRA name -> PEFT directory the engines serve; a respawned engine loads them all again.
        self.published_adapters: dict[str, str] = {}
        # The weight-update group the last full push left joined (miles.weights.kept_group.KeptGroup):
        # the next push reuses it while the members are the same. Written by miles.weights.push only.
        self.kept_push_group: Any = None
        # Why this job pushes in full though deltas are on (miles.weights.kept_group.DeltaOff: the engines
        # refused the digest or hold weights otherwise than sent, or deltas were slower), once learned; and
        # the pace of delta against full pushes that decides the latter. Written by miles.weights.push.
        self.delta_off: Any = None
        self.delta_pace: Any = None
        self.load = SamplingLoad()  # sampling in flight per engine (the elastic driver reads it)
        self.health = HealthChecker(
            health or HealthCheckConfig(),
            # FAILED cells stay targets (their probe fails) so a respawn that failed is retried later
            targets=lambda: [c for c in self.cells if c.serving or c.state in PROBED_UNSERVING],
            probe=self._probe,
            on_failed=self.respawn,
        )

    # ----- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every engine cell (concurrently); they end PENDING_WEIGHTS until the first push."""
        await asyncio.gather(*(cell.start() for cell in self.cells))

    def start_health_checks(self) -> None:
        self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        await asyncio.gather(*(cell.stop() for cell in self.cells), return_exceptions=True)

    def set_weight_refresher(self, refresher: WeightRefresher | None) -> None:
        """How a respawned engine gets the current weights before it is routed to."""
        self._refresher = refresher

    @property
    def update_in_progress(self) -> bool:
        return self._lock.locked()

    # ----- routing ---------------------------------------------------------------------------------------

    def ready_engines(self) -> list[SGLangApiClient]:
        return [cell.client for cell in self.ready_cells()]

    def ready_cells(self) -> list[Any]:
        return [cell for cell in self.cells if cell.state is CellState.READY]

    async def report_failure(self, cell: Any, client: SGLangApiClient, reason: str) -> None:
        """A request to `cell`'s engine (through `client`) failed in transport. If the engine does not
        answer a health probe either, it is taken out of routing now and handed to the health checker for a
        respawn, instead of being routed to until `failure_threshold` probe rounds have failed."""
        if cell.client is not client or not cell.serving:
            return  # already failed, or respawned since this request picked it
        if await self._probe_bounded(cell):
            return  # the engine answers: a reset of one connection, not a dead engine
        if cell.client is client and cell.serving:
            cell.mark_failed(reason)
            self.health.hand_over(cell)

    async def _probe_bounded(self, cell: Any) -> bool:
        try:
            return await asyncio.wait_for(self._probe(cell), self.health.config.timeout_s)
        except Exception:
            return False

    # ----- the weight-update bracket ---------------------------------------------------------------------

    @asynccontextmanager
    async def weight_update(
        self, *, wait_timeout_s: float = 600.0, base_weights: bool = True
    ) -> AsyncIterator[WeightUpdate]:
        """`base_weights=False` (LoRA adapter loads/unloads): the base weights stay as they are, so READY
        engines keep serving during the update and after a failed one; only engines that were waiting for
        weights (e.g. a respawned one) become READY on success."""
        update = await self.start_update_weights(wait_timeout_s=wait_timeout_s, base_weights=base_weights)
        try:
            yield update
        except BaseException:
            self.abort_update_weights(update)
            raise
        self.end_update_weights(update)

    async def start_update_weights(
        self, *, wait_timeout_s: float = 600.0, base_weights: bool = True
    ) -> WeightUpdate:
        update = WeightUpdate()
        try:
            await self._acquire_when_no_cell_starting(update, wait_timeout_s)
            update.paused_health = self.health.running
            self.health.pause()
            update.engines = [cell for cell in self.cells if cell.serving]
            if not update.engines:
                raise NoEnginesError("no engine is up to receive weights; see the engine cells' problems")
            if base_weights:  # a half-updated engine must never serve
                for cell in update.engines:
                    cell.mark_pending()
            update.version = self.weight_version + 1
            return update
        except BaseException:
            self.abort_update_weights(update)
            raise

    async def _acquire_when_no_cell_starting(self, update: WeightUpdate, wait_timeout_s: float) -> None:
        deadline = time.monotonic() + wait_timeout_s
        while True:
            await self._lock.acquire()
            update.holds_lock = True
            starting = [c.name for c in self.cells if c.state in (CellState.NEW, CellState.STARTING)]
            if not starting:
                return
            self._lock.release()  # let a respawn (which pushes inside its own bracket) proceed
            update.holds_lock = False
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines still starting after {wait_timeout_s:.0f} s: {starting}")
            await asyncio.sleep(WAIT_POLL_S)

    def end_update_weights(self, update: WeightUpdate) -> None:
        if update.finished:
            return
        for cell in update.engines:
            if cell.state is CellState.PENDING_WEIGHTS:
                cell.mark_ready()
                job_metrics().engines_ready.inc()
        self.weight_version = max(self.weight_version, update.version)
        self._finish(update)

    def abort_update_weights(self, update: WeightUpdate) -> None:
        """Synchronous, so it also runs to completion inside a cancelled task."""
        if update.finished:
            return
        logger.warning("weight update to version %d aborted; no engine marked ready", update.version)
        self._finish(update)

    def _finish(self, update: WeightUpdate) -> None:
        update.finished = True
        if update.paused_health:
            self.health.resume()
        if update.holds_lock:
            update.holds_lock = False
            self._lock.release()

    # ----- respawn ---------------------------------------------------------------------------------------

    async def _probe(self, cell: Any) -> bool:
        if cell.state is CellState.FAILED or cell.client is None:
            return False
        if cell.state is CellState.RELEASED:
            # SGLang's /health generates a token, which a released engine cannot: ask its HTTP process
            return await cell.client.alive(timeout_s=self.health.config.timeout_s)
        return await cell.client.health(timeout_s=self.health.config.timeout_s)

    def set_respawn_gate(self, gate: RespawnGate | None) -> None:
        """What a respawn holds while the new engine starts and gets its weights (colocated jobs: the
        GPUs on the sampling side, so a starting engine never takes memory from a training step)."""
        self._respawn_gate = gate

    async def respawn(self, cell: Any) -> None:
        """Replace a failed engine on its bundle, then push the current weights before routing to it."""
        cell.mark_failed(cell.problem or "failed health checks")
        async with self._respawn_gate() if self._respawn_gate else contextlib.nullcontext():
            logger.warning("%s: respawning", cell.name)
            await cell.restart()
            await self.refresh_weights()

    def fail_engine(self, cell: Any, reason: str) -> None:
        """Take `cell` out now and end its process (so whatever GPU memory it holds is freed); the health
        checker respawns it."""
        cell.kill(reason)
        self.health.hand_over(cell)

    async def refresh_weights(self) -> None:
        if self._refresher is not None:
            await self._refresher(self)
        else:
            async with self.weight_update():
                pass  # a frozen model: the engine loaded the served weights from disk
