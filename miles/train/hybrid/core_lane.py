"""The core trainer cell's rank 0 as the hybrid lanes' core lane, seen by HybridTrainer as a lane actor.

HybridTrainer calls `lane.actor.<method>.remote(...)` on every lane; for the core those calls go to the
trainer rank's `TrainerWorker.lane_call`, which runs the HybridLane method over the rank's own backend. So
the coordinator drives the core and the borrowed lanes alike, and the core trainer's default group and
model are the ones the trainer commands use (nothing rebuilt or loaded twice). `ping` goes to the rank's
own health-group ping, answered while the rank is busy in a collective.
"""

from __future__ import annotations

from typing import Any

from miles.train.hybrid.coordinator import Lane
from miles.train.worker import CORE_LANE


class _LaneMethod:
    def __init__(self, worker: Any, method: str) -> None:
        self._worker, self._method = worker, method

    def remote(self, *args: Any) -> Any:
        if self._method == "ping":
            return self._worker.ping.remote()
        return self._worker.lane_call.remote(self._method, *args)


class CoreLaneHandle:
    """A TrainerWorker actor (rank 0 of a one-rank trainer cell) with a HybridLane actor's interface."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def __getattr__(self, method: str) -> _LaneMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _LaneMethod(self._worker, method)


async def core_lane(worker: Any, run: str) -> Lane:
    """The core lane over `worker`'s backend, counters fresh for `run`."""
    await worker.lane_call.remote("adopt", run)
    return Lane(CORE_LANE, CoreLaneHandle(worker))
