"""Sampling slots per lane: at most `limit` runtime samples at once in each lane.

A lane is what one set of engines serves: the runtime's `sampling_lane(target)` (a catalog job: the
instance a target runs on), or one lane for a runtime of one model. So one instance's backlog never holds
back another's samples. A lane's semaphore exists while a sample holds or waits for it, so lanes of
released instances leave nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class _Lane:
    semaphore: asyncio.Semaphore
    users: int = 0  # holding or waiting
    running: int = 0  # holding a slot


class SampleSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # GatewaySettings.max_concurrent_samples (at least 1)
        self._lanes: dict[str, _Lane] = {}

    @contextlib.asynccontextmanager
    async def lane(self, key: str) -> AsyncIterator[None]:
        """Hold one of lane `key`'s slots for the block (waiting for one first). Leaving the block, also by
        cancellation (a closed stream, a timeout), frees the slot."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(asyncio.Semaphore(self.limit))
        lane.users += 1
        try:
            async with lane.semaphore:
                lane.running += 1
                try:
                    yield
                finally:
                    lane.running -= 1
        finally:
            lane.users -= 1
            if lane.users == 0:
                del self._lanes[key]

    def running(self, key: str) -> int:
        """Samples holding a slot of lane `key` now."""
        lane = self._lanes.get(key)
        return 0 if lane is None else lane.running

    def lanes(self) -> list[str]:
        return sorted(self._lanes)
