"""CoreLaneHandle: which lane calls reach every rank of a core of several ranks. A core whose optimizer
state is cut over its ranks (megatron) runs the state calls on every rank too: the gather is a collective
of its DP group, and a rank left out would leave the others waiting in it."""

from __future__ import annotations

import asyncio
from typing import Any

from miles.train.hybrid.core_lane import CoreLaneHandle


class _Worker:
    def __init__(self, rank: int, calls: list[tuple[int, str]]) -> None:
        self.rank, self.calls = rank, calls
        self.lane_call = self

    def remote(self, method: str, *args: Any) -> Any:
        self.calls.append((self.rank, method))

        async def answer() -> str:
            return f"{method} from rank {self.rank}"

        return answer()


def _ranks_called(handle: CoreLaneHandle, method: str, calls: list[tuple[int, str]]) -> tuple[list[int], str]:
    calls.clear()
    answer = asyncio.run(_await(getattr(handle, method).remote("full")))
    return sorted(rank for rank, _ in calls), answer


async def _await(value: Any) -> Any:
    return await value


def test_state_calls_reach_every_rank_only_when_the_state_is_sharded() -> None:
    calls: list[tuple[int, str]] = []
    workers = [_Worker(rank, calls) for rank in range(3)]
    plain, sharded = CoreLaneHandle(workers), CoreLaneHandle(workers, sharded_state=True)
    for method in ("check_state", "receive_state", "digest", "snapshot"):
        assert _ranks_called(plain, method, calls) == ([0], f"{method} from rank 0")
        assert _ranks_called(sharded, method, calls) == ([0, 1, 2], f"{method} from rank 0")
    for method in ("forward_backward", "optim_step"):  # a step involves every rank either way
        assert _ranks_called(plain, method, calls)[0] == [0, 1, 2]
    assert _ranks_called(sharded, "open_store", calls)[0] == [0]  # only rank 0 ever meets the lanes
