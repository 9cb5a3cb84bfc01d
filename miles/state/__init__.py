"""State the gateway must not lose: the StateStore protocol and its memory/Redis implementations.

Only this package imports redis; everything else opens a store through `open_state_store`.
"""

from __future__ import annotations

from miles.state.memory import MemoryStateStore
from miles.state.store import (
    ConcurrencyError,
    JsonDict,
    StateStore,
    StateStoreError,
    StateStoreUnavailable,
    UpdateFn,
)

__all__ = [
    "ConcurrencyError",
    "JsonDict",
    "MemoryStateStore",
    "StateStore",
    "StateStoreError",
    "StateStoreUnavailable",
    "UpdateFn",
    "open_state_store",
]

DEFAULT_REDIS_KEY_PREFIX = "miles"


def open_state_store(url: str | None, *, key_prefix: str = DEFAULT_REDIS_KEY_PREFIX) -> StateStore:
    """`None` or `memory://` -> MemoryStateStore; `redis://` / `rediss://` / `unix://` -> RedisStateStore."""
    if url is None or url in ("memory://", "memory"):
        return MemoryStateStore()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        from miles.state.redis_store import RedisStateStore

        return RedisStateStore(url, key_prefix=key_prefix)
    raise ValueError(f"unsupported state store URL {url!r}: use memory:// (default) or redis://HOST:PORT/DB")
