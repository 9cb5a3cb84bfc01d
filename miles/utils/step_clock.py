"""Wall seconds of the named steps of one piece of work (a push, a colocated switch, a rank's share)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Iterator
from typing import Any


class StepClock:
    """`with clock("pause"): ...` adds the block's seconds to `steps["pause"]` (a step timed twice sums)."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.steps: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - start

    async def timed(self, name: str, awaitable: Awaitable[Any]) -> Any:
        """Await `awaitable`, timing it as step `name` (for steps that run beside others)."""
        with self(name):
            return await awaitable
