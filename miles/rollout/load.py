"""Sampling requests in flight per engine, and when sampling was last seen: what the elastic controller
observes to tell idle engines (miles/elastic) from busy ones."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SamplingLoad:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_flight: Counter[str] = Counter()  # engine cell name -> requests running there
        self.last_at: float | None = None  # when a request was last in flight (None: never)

    @contextmanager
    def track(self, engine: str) -> Iterator[None]:
        self.in_flight[engine] += 1
        self.last_at = self._clock()
        try:
            yield
        finally:
            self.in_flight[engine] -= 1
            self.last_at = self._clock()  # it was in flight until now
            if self.in_flight[engine] <= 0:
                del self.in_flight[engine]

    def total(self) -> int:
        return sum(self.in_flight.values())

    def busy(self) -> frozenset[str]:
        return frozenset(self.in_flight)
