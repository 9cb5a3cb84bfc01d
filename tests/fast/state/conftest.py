"""Store fixtures: every test in this folder runs against the memory store and a real Redis.

Redis comes from MILES_TEST_REDIS_URL when set (.ci/run starts one), else a private redis-server on a free
port for this session, else the Redis cases skip with the reason.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from miles.state import MemoryStateStore, StateStore


class FakeClock:
    """A settable monotonic clock for TTL tests on the memory store."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_key_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def advance(store: StateStore, clock: FakeClock) -> Callable[[float], Awaitable[None]]:
    """Let `seconds` pass for the store: the memory store's clock jumps, Redis really waits."""

    async def _advance(seconds: float) -> None:
        if isinstance(store, MemoryStateStore):
            clock.now += seconds
        else:
            await asyncio.sleep(seconds)

    return _advance


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[StateStore]:
    """One store per test; Redis stores get a unique key prefix and are purged afterwards."""
    if request.param == "memory":
        mem = MemoryStateStore(clock=clock)
        yield mem
        await mem.close()
        return
    from miles.state.redis_store import RedisStateStore

    url = request.getfixturevalue("redis_url")
    red = RedisStateStore(url, key_prefix=request.getfixturevalue("redis_key_prefix"))
    try:
        yield red
    finally:
        await red.purge()
        await red.close()
