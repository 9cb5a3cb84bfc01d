"""In-process StateStore: the default when no Redis URL is configured.

Values are stored as JSON text, so callers get fresh copies and a value that Redis would refuse is refused
here too. One threading lock guards the maps: every method's critical section is synchronous, so the
store is safe across tasks of one loop and across loops/threads of one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from miles.state.store import (
    JsonDict,
    UpdateFn,
    check_address,
    check_ttl,
    decode_value,
    encode_value,
)

Clock = Callable[[], float]


class MemoryStateStore:
    def __init__(self, *, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._values: dict[tuple[str, str], tuple[str, float | None]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise RuntimeError("MemoryStateStore is closed")
            yield

    def _expiry(self, ttl_s: float | None) -> float | None:
        check_ttl(ttl_s)
        return None if ttl_s is None else self._clock() + ttl_s

    def _live(self, address: tuple[str, str]) -> tuple[str, float | None] | None:
        """The stored entry if it has not expired; expired entries are dropped on sight."""
        entry = self._values.get(address)
        if entry is None:
            return None
        expires_at = entry[1]
        if expires_at is not None and self._clock() >= expires_at:
            del self._values[address]
            return None
        return entry

    async def get(self, ns: str, key: str) -> JsonDict | None:
        check_address(ns, key)
        with self._locked():
            entry = self._live((ns, key))
        return None if entry is None else decode_value(entry[0])

    async def put(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> None:
        check_address(ns, key)
        raw = encode_value(ns, key, value)
        with self._locked():
            self._values[(ns, key)] = (raw, self._expiry(ttl_s))

    async def put_if_absent(self, ns: str, key: str, value: JsonDict, *, ttl_s: float | None = None) -> bool:
        check_address(ns, key)
        raw = encode_value(ns, key, value)
        with self._locked():
            if self._live((ns, key)) is not None:
                return False
            self._values[(ns, key)] = (raw, self._expiry(ttl_s))
            return True

    async def delete(self, ns: str, key: str) -> bool:
        check_address(ns, key)
        with self._locked():
            present = self._live((ns, key)) is not None
            self._values.pop((ns, key), None)
            return present

    async def list(self, ns: str, prefix: str = "") -> list[tuple[str, JsonDict]]:
        check_address(ns, "-")
        with self._locked():
            keys = sorted(k for (n, k) in list(self._values) if n == ns and k.startswith(prefix))
            entries = [(k, self._live((ns, k))) for k in keys]
        return [(k, decode_value(e[0])) for k, e in entries if e is not None]

    async def update(self, ns: str, key: str, fn: UpdateFn, *, ttl_s: float | None = None) -> JsonDict | None:
        check_address(ns, key)
        check_ttl(ttl_s)
        with self._locked():
            entry = self._live((ns, key))
            current = None if entry is None else decode_value(entry[0])
            new = fn(current)
            if new is None:
                self._values.pop((ns, key), None)
                return None
            raw = encode_value(ns, key, new)
            keep_expiry = None if entry is None else entry[1]
            self._values[(ns, key)] = (raw, keep_expiry if ttl_s is None else self._expiry(ttl_s))
        return decode_value(raw)

    async def purge(self) -> None:
        """Forget everything (tests, resets)."""
        with self._locked():
            self._values.clear()

    async def ping(self) -> None:
        with self._locked():
            pass

    async def close(self) -> None:
        with self._lock:
            self._closed = True
