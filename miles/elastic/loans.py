"""Carrying out a borrow or a return: the engine, the lane and the ledger moved together, or not at all.

The engine and lane sides are ports (an engine cell and a lane launcher adapt to them), so the order and
the rollbacks are one piece of logic, tested on its own. The caller runs these at a step boundary, inside
the weight-update lock (no push or respawn in between). Each phase is timed (bench and logs).

Borrow:  ledger.drain -> engine.drain -> engine.release -> ledger.freed -> lanes.start -> trainer.join
         -> ledger.lane_started. An engine that cannot be drained or released keeps serving (shortfall
         recorded); a lane that cannot start or join is stopped and the engine restored: as before.
Return:  trainer.leave -> lanes.stop -> ledger.lane_stopped -> engine.restore (current weights before it
         is routed to) -> ledger.serving. A leave that fails leaves the lane lent, as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.elastic.ledger import GpuLedger, LoanState

log = logging.getLogger(__name__)


class EnginePort(Protocol):
    async def drain(self, timeout_s: float) -> str | None:
        """Pause and wait out in-flight requests; None when drained, else why not (then still serving)."""

    async def release(self) -> None:
        """Stop the engine process and release its GPU memory."""

    async def restore(self) -> None:
        """Start the engine again with the current weights; routable only when this returns."""


class LanePort(Protocol):
    async def start(self, engine: str) -> Any:
        """A set-up hybrid lane (miles.train.hybrid.coordinator.Lane) on `engine`'s GPUs."""

    async def stop(self, lane: Any) -> None: ...


class TrainerPort(Protocol):
    async def join(self, lane: Any) -> None: ...

    async def leave(self, name: str) -> None: ...


@dataclass
class Outcome:
    engine: str
    action: str  # "borrow" | "return"
    ok: bool
    reason: str
    phases: dict[str, float] = field(default_factory=dict)


class _Clock:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self._mark = now - self._mark, now


class LoanExecutor:
    def __init__(
        self,
        ledger: GpuLedger,
        trainer: TrainerPort,
        lanes: LanePort,
        engines: dict[str, EnginePort],
        *,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.ledger, self.trainer, self.lanes, self.engines = ledger, trainer, lanes, engines
        self.drain_timeout_s = drain_timeout_s
        self._lanes_by_engine: dict[str, Any] = {}

    async def borrow(self, engine: str) -> Outcome:
        refusal = self.ledger.refusal(engine)
        if refusal is not None:
            return Outcome(engine, "borrow", False, refusal)
        port, clock = self.engines[engine], _Clock()
        self.ledger.drain(engine)
        why = await _failure_of(port.drain(self.drain_timeout_s))
        clock.lap("drain")
        if why is None:
            why = await _failure_of(port.release(), "release failed")
            clock.lap("free")
            if why is not None:
                await port.restore()  # a half-stopped engine comes back whole before it serves again
        if why is not None:
            self.ledger.cannot_free(engine, why)
            return self._done(Outcome(engine, "borrow", False, f"engine kept serving: {why}", clock.phases))
        self.ledger.freed(engine)
        return await self._start_lane(engine, port, clock)

    async def _start_lane(self, engine: str, port: EnginePort, clock: _Clock) -> Outcome:
        lane = None
        try:
            lane = await self.lanes.start(engine)
            clock.lap("start")
            await self.trainer.join(lane)
            clock.lap("state_transfer")
        except Exception as exc:
            self.ledger.lane_failed(engine)
            if lane is not None:
                await self.lanes.stop(lane)
            await port.restore()
            self.ledger.serving(engine)
            clock.lap("rollback")
            reason = f"lane failed, engine restored: {type(exc).__name__}: {exc}"
            return self._done(Outcome(engine, "borrow", False, reason, clock.phases))
        self.ledger.lane_started(engine, lane.name)
        self._lanes_by_engine[engine] = lane
        return self._done(Outcome(engine, "borrow", True, f"lane {lane.name} joined", clock.phases))

    async def give_back(self, engine: str) -> Outcome:
        detached = await self.detach(engine)
        if not detached.ok:
            return detached
        restored = await self.restore(engine)
        restored.phases = {**detached.phases, **restored.phases}
        return restored

    async def detach(self, engine: str) -> Outcome:
        """The first half of a return, at a step boundary: the lane leaves and stops (engine RETURNING)."""
        loan = self.ledger.loans[engine]
        if loan.state is not LoanState.LENT:
            return Outcome(engine, "return", False, f"engine {engine} is {loan.state.value}, not lent")
        lane, clock = self._lanes_by_engine[engine], _Clock()
        why = await _failure_of(self.trainer.leave(lane.name), "leave failed")
        if why is not None:
            return self._done(Outcome(engine, "return", False, f"lane stays lent: {why}", clock.phases))
        clock.lap("leave")
        await self.lanes.stop(lane)
        del self._lanes_by_engine[engine]
        self.ledger.lane_stopped(engine)
        clock.lap("stop_lane")
        return Outcome(engine, "return", True, f"lane {lane.name} left", clock.phases)

    async def restore(self, engine: str) -> Outcome:
        """The second half: the engine restarted with the current weights, then serving. Its own step, so a
        caller holding the training lock can release it first (a full model's refresh takes that lock)."""
        clock = _Clock()
        await self.engines[engine].restore()  # failing here leaves it RETURNING (GPUs free, never routed)
        self.ledger.serving(engine)
        clock.lap("serving")
        return self._done(
            Outcome(engine, "return", True, "engine serving with current weights", clock.phases)
        )

    @staticmethod
    def _done(outcome: Outcome) -> Outcome:
        level = logging.INFO if outcome.ok else logging.WARNING
        log.log(
            level,
            "elastic %s engine %s: %s %s",
            outcome.action,
            outcome.engine,
            outcome.reason,
            outcome.phases,
        )
        return outcome


async def _failure_of(call: Any, prefix: str = "") -> str | None:
    """Await `call`; its answer if it returns a reason, or the error as text."""
    try:
        answer = await call
    except Exception as exc:
        return f"{prefix + ': ' if prefix else ''}{type(exc).__name__}: {exc}"
    return answer if isinstance(answer, str) else None
