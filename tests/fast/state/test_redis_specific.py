"""Redis-only behaviour: bounded optimistic retries, clear errors, prefixes kept apart, URL dispatch."""

from __future__ import annotations

import socket

import pytest
import redis

from miles.state import ConcurrencyError, MemoryStateStore, StateStoreError, open_state_store
from miles.state.redis_store import RedisStateStore


async def test_update_gives_up_with_concurrency_error_when_always_raced(
    redis_url: str, redis_key_prefix: str
) -> None:
    store = RedisStateStore(redis_url, redis_key_prefix, max_update_retries=3)
    rival = redis.Redis.from_url(redis_url)
    calls = 0

    def raced(current: dict | None) -> dict:
        nonlocal calls
        calls += 1
        rival.set(f"{redis_key_prefix}:v:hot:key", f'{{"rival": {calls}}}')  # a writer between WATCH and EXEC
        return {"mine": True}

    try:
        with pytest.raises(ConcurrencyError, match="lost 3 races"):
            await store.update("hot", "key", raced)
        assert calls == 3
        assert await store.get("hot", "key") == {"rival": 3}
    finally:
        await store.purge()
        await store.close()
        rival.close()


async def test_prefixes_do_not_see_each_other(redis_url: str, redis_key_prefix: str) -> None:
    a = RedisStateStore(redis_url, redis_key_prefix + "-a")
    b = RedisStateStore(redis_url, redis_key_prefix + "-ab")
    try:
        await a.put("ns", "k", {"owner": "a"})
        await b.put("ns", "k", {"owner": "b"})
        assert await a.list("ns") == [("k", {"owner": "a"})]
        await a.purge()
        assert await b.get("ns", "k") == {"owner": "b"}
        assert await a.get("ns", "k") is None
    finally:
        await a.purge()
        await b.purge()
        await a.close()
        await b.close()


async def test_unreachable_redis_is_a_clear_error_without_password() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = RedisStateStore(f"redis://:s3cret@127.0.0.1:{port}/0", "p", timeout_s=2)
    try:
        with pytest.raises(StateStoreError) as info:
            await store.get("ns", "k")
        assert f"127.0.0.1:{port}" in str(info.value)
        assert "s3cret" not in str(info.value)
    finally:
        await store.close()


async def test_open_state_store_dispatches_on_url(redis_url: str) -> None:
    assert isinstance(open_state_store(None), MemoryStateStore)
    assert isinstance(open_state_store("memory://"), MemoryStateStore)
    red = open_state_store(redis_url, key_prefix="dispatch-test")
    assert isinstance(red, RedisStateStore)
    await red.close()
    with pytest.raises(ValueError, match="redis://"):
        open_state_store("postgres://db")
