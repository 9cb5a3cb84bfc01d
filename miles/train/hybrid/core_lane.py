"""The core trainer cell as the hybrid lanes' core lane, seen by HybridTrainer as one lane actor.

HybridTrainer calls `lane.actor.<method>.remote(...)` on every lane; for the core those calls go to the
trainer ranks' `TrainerWorker.lane_call`, which runs the HybridLane method over the rank's own backend. So
the coordinator drives the core and the borrowed lanes alike, and the core trainer's default group and
model are the ones the trainer commands use (nothing rebuilt or loaded twice).

A core of several ranks: the calls that change the trainable state or take part in a step
(`EVERY_RANK`) reach every rank, whose backend splits the core's share across the ranks and whose
optim_step sums inside the core group before rank 0 joins the lanes' sum; the answer is rank 0's. Everything
else (the store, the lanes' groups, state copies and checks, counters) is rank 0's alone: the other ranks
never meet the lanes. `ping` goes to rank 0's health-group ping, answered while the rank is busy. A core
whose optimizer state is cut over its ranks (megatron: `sharded_state`) runs the state calls on every rank
too (`SHARDED_STATE`): gathering the state is a collective of the core's DP group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from miles.train.hybrid.coordinator import Lane
from miles.train.worker import CORE_LANE

EVERY_RANK = frozenset({"adopt", "create_adapter", "forward_backward", "optim_step", "abort_step"})
SHARDED_STATE = frozenset({"receive_state", "check_state", "digest", "snapshot"})


async def _rank0_answer(calls: Sequence[Any]) -> Any:
    return (await asyncio.gather(*calls))[0]


class _LaneMethod:
    def __init__(self, workers: Sequence[Any], method: str, every_rank: frozenset[str]) -> None:
        self._workers, self._method, self._every_rank = workers, method, every_rank

    def remote(self, *args: Any) -> Any:
        rank0 = self._workers[0]
        if self._method == "ping":
            return rank0.ping.remote()
        if self._method in self._every_rank and len(self._workers) > 1:
            return _rank0_answer([w.lane_call.remote(self._method, *args) for w in self._workers])
        return rank0.lane_call.remote(self._method, *args)


class CoreLaneHandle:
    """The core trainer cell's TrainerWorker actors, in rank order, with a HybridLane actor's interface."""

    def __init__(self, workers: Sequence[Any], *, sharded_state: bool = False) -> None:
        if not workers:
            raise ValueError("a core lane needs the trainer cell's ranks")
        self._workers = list(workers)
        self._every_rank = EVERY_RANK | SHARDED_STATE if sharded_state else EVERY_RANK

    def __getattr__(self, method: str) -> _LaneMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _LaneMethod(self._workers, method, self._every_rank)


async def core_lane(workers: Sequence[Any], run: str, *, sharded_state: bool = False) -> Lane:
    """The core lane over the trainer ranks' backends (rank order), counters fresh for `run`."""
    handle = CoreLaneHandle(workers, sharded_state=sharded_state)
    await handle.adopt.remote(run)
    return Lane(CORE_LANE, handle)
