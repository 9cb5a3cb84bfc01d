"""ElasticDriver: the loop that borrows and returns engines in a running job (docs/elastic.md).

It sits where the runtime runs trainer commands, under the runtime's training lock, so a decision is
taken only between commands, and acted on only at a step boundary (no forward_backward waiting for its
optimizer step). It decides before the first forward_backward of a step (training is about to run: that
request counts as waiting) and after every optimizer step, and a poller decides while the trainer is idle
(sampling demand coming back returns a lane without waiting for the next step).

Observations: the gateway's training queues (`watch_training_queue`, through the Runtime seam) and the
sampling in flight per engine (`InferenceController.load`). A borrow runs inside the weight-update bracket
(`weight_update(base_weights=False)`: no push, respawn or probe meanwhile); a return detaches the lane
under the lock and restores the engine after it is released, since a full model's weight refresh takes
the training lock itself. Nothing is decided while an engine is starting, waiting for weights or being
restored: a bracket opened then could mark such an engine ready without its weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from miles.elastic.loans import LoanExecutor, Outcome
from miles.elastic.metrics import ElasticMetrics
from miles.elastic.policy import Decision, ElasticController, Observation
from miles.elastic.routing import HybridRouter
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.train.commands import ForwardBackward, OptimStep, TrainerCommand

log = logging.getLogger(__name__)

SETTLED = (CellState.READY, CellState.LENT)  # engine states a decision may be taken in
RECENT_OUTCOMES = 20


class ElasticDriver:
    def __init__(
        self,
        policy: ElasticController,
        loans: LoanExecutor,
        router: HybridRouter,
        inference: InferenceController,
        train_lock: asyncio.Lock,
        *,
        metrics: ElasticMetrics | None = None,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy, self.loans, self.router, self.inference = policy, loans, router, inference
        self.train_lock, self.metrics, self.poll_s, self.clock = train_lock, metrics, poll_s, clock
        self.queue_depth: Callable[[], int] = lambda: 0  # set by watch_training_queue
        self.outcomes: list[Outcome] = []  # the latest borrows and returns, newest last
        self._tasks: set[asyncio.Task[Any]] = set()
        self._poller: asyncio.Task[None] | None = None

    @property
    def ledger(self) -> Any:
        return self.loans.ledger

    def watch_training_queue(self, waiting: Callable[[], int]) -> None:
        self.queue_depth = waiting

    # ---- observing --------------------------------------------------------------------------------

    def observe(self, *, about_to_train: bool = False) -> Observation:
        load = self.inference.load
        return Observation(
            now=self.clock(),
            training_waiting=self.queue_depth() + int(about_to_train),
            sampling_in_flight=load.total(),
            last_sampling_at=load.last_at,
            busy_engines=load.busy(),  # by cell name, as the ledger names engines (miles.driver.elastic)
            dead_lanes=self.router.hybrid.dead_lanes,  # their engines go back at the next decision
        )

    # ---- commands (the runtime's training lock is held) -------------------------------------------

    async def run(self, command: TrainerCommand[Any]) -> Any:
        if isinstance(command, ForwardBackward) and not command.forward_only:
            await self._decide_safely(about_to_train=True)
        result = await self.router.run(command)
        if isinstance(command, OptimStep):
            await self._decide_safely()
        return result

    async def _decide_safely(self, *, about_to_train: bool = False) -> None:
        """A decision that fails (no engine to bracket, a timeout) never fails the training command."""
        try:
            await self.decide(about_to_train=about_to_train)
        except Exception:
            log.exception("elastic: a decision failed; training goes on with the lanes it has")

    async def decide(self, *, about_to_train: bool = False) -> Decision | None:
        """One decision, carried out; None when this is no moment for one. The caller holds the lock."""
        if not self.router.hybrid.at_boundary() or not self._settled():
            return None
        decision = self.policy.decide(self.observe(about_to_train=about_to_train))
        if decision.action == "borrow" and decision.engine is not None:
            async with self.inference.weight_update(base_weights=False):
                self._record(await self.loans.borrow(decision.engine))
        elif decision.action == "return" and decision.engine is not None:
            detached = self._record(await self.loans.detach(decision.engine))
            if detached.ok:
                self._spawn(self._restore(decision.engine))
        if self.metrics is not None:
            self.metrics.observe_ledger(self.ledger)
        return decision

    def _settled(self) -> bool:
        return not self._tasks and all(cell.state in SETTLED for cell in self.inference.cells)

    async def _restore(self, engine: str) -> None:
        try:
            self._record(await self.loans.restore(engine))
        except Exception:
            log.exception("elastic: engine %s could not be restored; it stays out of routing", engine)
        if self.metrics is not None:
            self.metrics.observe_ledger(self.ledger)

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes = [*self.outcomes[-(RECENT_OUTCOMES - 1) :], outcome]
        return outcome

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for restores in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- while the trainer is idle ----------------------------------------------------------------

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll(), name="elastic-driver")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            async with self.train_lock:
                await self._decide_safely()

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.settle()

    # ---- status -----------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Lanes and GPU owners, as plain data (the gateway's catalog route; `launcher status`)."""
        ledger, hybrid = self.ledger, self.router.hybrid
        return {
            "enabled": self.policy.settings.enabled,
            "epoch": hybrid.epoch,
            "lanes": [lane.name for lane in hybrid.lanes],
            "engines": {name: loan.state.value for name, loan in sorted(ledger.loans.items())},
            "owners": {str(gpu): owner for gpu, owner in sorted(ledger.owners().items(), key=_gpu_key)},
            "shortfalls": list(ledger.shortfalls),
            "recent": [
                {"engine": o.engine, "action": o.action, "ok": o.ok, "reason": o.reason, "phases": o.phases}
                for o in self.outcomes
            ],
        }


def _gpu_key(item: tuple[Any, str]) -> tuple[str, int]:
    return item[0].host, item[0].index
