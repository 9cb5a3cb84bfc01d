"""Pure: which sampler adapters stay loaded on the engines.

Every `save_weights_for_sampler` of a LoRA model adds an adapter to the engines; an RL loop saves one per
step, and SGLang serves at most `--max-loras-per-batch` of them. This keeps the most recently used
`limit` and names the rest for unloading — never one that a request is sampling from right now (an
evicted snapshot loads again on its next use: snapshots are immutable directories).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager


class AdapterResidency:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"at least one adapter must stay loaded (limit {limit})")
        self.limit = limit
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._in_use: Counter[str] = Counter()

    def loaded(self) -> list[str]:
        return list(self._order)

    def touch(self, name: str) -> None:
        """`name` is loaded and was just used."""
        self._order[name] = None
        self._order.move_to_end(name)

    def acquire(self, name: str) -> None:
        """A request samples from `name` until `release(name)`: it cannot be evicted meanwhile."""
        self.touch(name)
        self._in_use[name] += 1

    def release(self, name: str) -> None:
        self._in_use[name] -= 1
        if self._in_use[name] <= 0:
            del self._in_use[name]

    @contextmanager
    def using(self, name: str) -> Iterator[None]:
        self.acquire(name)
        try:
            yield
        finally:
            self.release(name)

    def victims(self) -> list[str]:
        """Least recently used adapters over the limit that no request is using; forgotten here.

        The most recently used one always stays: it was just loaded for a request."""
        excess = len(self._order) - self.limit
        older = list(self._order)[:-1]
        chosen = [name for name in older if not self._in_use[name]][: max(excess, 0)]
        for name in chosen:
            del self._order[name]
        return chosen
