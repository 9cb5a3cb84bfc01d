"""A Redis that stops answering (paused) or goes away (stopped) and comes back, on a private redis-server.

Every store call fails within its bound with StateStoreUnavailable (category "unavailable": the gateway's
503) instead of hanging, and the same store object serves again once Redis is back: no reconnect by hand.
A future whose work finished during the outage keeps its outcome and reports it afterwards.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from miles.errors import Category
from miles.state import StateStoreUnavailable
from miles.state.futures import FutureRepository, FutureState
from miles.state.local_redis import LocalRedisServer
from miles.state.redis_store import RedisStateStore

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

BOUND_S = 0.3
PAUSE_MS = 4000


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    """Its own redis-server: pausing or stopping the shared one would break other tests."""
    srv = LocalRedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


def _pause(srv: LocalRedisServer) -> float:
    """CLIENT PAUSE every client (no command runs until it ends); returns when it ends (monotonic)."""
    with redis.Redis.from_url(srv.url) as admin:
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
    return time.monotonic() + PAUSE_MS / 1000


def _calls(store: RedisStateStore) -> dict[str, object]:
    return {
        "get": lambda: store.get("ns", "k"),
        "put": lambda: store.put("ns", "k2", {"v": 2}),
        "put_if_absent": lambda: store.put_if_absent("ns", "k3", {"v": 3}),
        "update": lambda: store.update("ns", "k", lambda v: {"v": (v or {}).get("v", 0) + 1}),
        "delete": lambda: store.delete("ns", "k"),
        "list": lambda: store.list("ns"),
        "ping": store.ping,
    }


async def _each_call_is_unavailable(store: RedisStateStore, expect: str) -> dict[str, float]:
    took = {}
    for name, call in _calls(store).items():
        started = time.monotonic()
        with pytest.raises(StateStoreUnavailable) as info:
            await call()
        took[name] = time.monotonic() - started
        assert info.value.category is Category.UNAVAILABLE
        assert expect in str(info.value) and store._url in str(info.value), name
    return took


async def test_a_paused_redis_fails_every_call_within_the_bound_then_the_same_store_serves(
    server: LocalRedisServer,
) -> None:
    store = RedisStateStore(server.url, "outage", timeout_s=BOUND_S)
    try:
        await store.put("ns", "k", {"v": 1})
        pause_ends = _pause(server)
        took = await _each_call_is_unavailable(store, f"did not answer within {BOUND_S:g} s")
        # Each call gave up near its bound, long before the pause ended (it would have answered then).
        assert max(took.values()) < PAUSE_MS / 1000 / 2, took
        assert time.monotonic() < pause_ends, "the calls outlasted the pause: the check proves nothing"
        await asyncio.sleep(pause_ends - time.monotonic() + 0.2)
        assert await store.get("ns", "k") == {"v": 1}
        assert await store.update("ns", "k", lambda v: {"v": v["v"] + 1}) == {"v": 2}
    finally:
        await store.close()


async def test_a_stopped_redis_is_unavailable_and_the_same_store_reconnects_when_it_returns(
    server: LocalRedisServer,
) -> None:
    store = RedisStateStore(server.url, "outage", timeout_s=BOUND_S)
    try:
        await store.put("ns", "k", {"v": 1})
        server.stop(save=True)
        await _each_call_is_unavailable(store, "is unreachable")
        server.start()  # same port, same data
        # The pooled connection died with the old server; the first call reconnects instead of failing.
        assert await store.get("ns", "k") == {"v": 1}
        assert await store.put_if_absent("ns", "k9", {"v": 9})
    finally:
        await store.close()


async def test_the_urls_socket_timeout_is_the_bound(server: LocalRedisServer) -> None:
    store = RedisStateStore(server.url + "?socket_timeout=0.25", "outage")
    try:
        assert store.timeout_s == 0.25
        _pause(server)
        with pytest.raises(StateStoreUnavailable, match=r"within 0\.25 s"):
            await store.get("ns", "k")
    finally:
        await store.close()
    with pytest.raises(ValueError, match="socket_timeout='soon'"):
        RedisStateStore(server.url + "?socket_timeout=soon", "outage")


async def test_an_outcome_reached_while_the_store_is_down_is_reported_once_it_returns(
    server: LocalRedisServer,
) -> None:
    store = RedisStateStore(server.url, "outage", timeout_s=BOUND_S)
    futures = FutureRepository(store, ttl_s=60)
    try:
        await futures.open("req-done", "alice", "ForwardBackward")
        await futures.open("req-failed", "alice", "OptimStep")
        await futures.mark_running("req-done")
        waiter = asyncio.create_task(futures.wait("alice", "req-done", 30))
        await asyncio.sleep(0.05)
        server.stop(save=True)
        # The work finished; its outcome cannot be written, and nothing raises into the operation runner.
        assert await futures.complete("req-done", b"\x08\x01result") is None
        assert await futures.fail("req-failed", "bad adam params", Category.USER) is None
        assert futures.pending_count() == 0
        with pytest.raises(StateStoreUnavailable):  # the woken waiter re-reads: still down
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(StateStoreUnavailable):
            await futures.wait("alice", "req-done", 0.01)
        server.start()
        done = await futures.wait("alice", "req-done", 0.01)
        assert done.state is FutureState.COMPLETE and done.result_bytes() == b"\x08\x01result"
        failed = await futures.wait("alice", "req-failed", 0.01)
        assert failed.state is FutureState.FAILED and failed.error.message == "bad adam params"
        assert failed.error.category == "user"
        # Written: a gateway restarted now (another owner) reads the same outcome from Redis.
        again = await FutureRepository(store, owner="restarted").wait("alice", "req-done", 0.01)
        assert again.result_bytes() == b"\x08\x01result"
    finally:
        await store.close()


async def test_a_poll_during_an_outage_is_paced_and_rides_over_a_short_one(server: LocalRedisServer) -> None:
    store = RedisStateStore(server.url, "outage", timeout_s=BOUND_S)
    futures = FutureRepository(store, ttl_s=60, outage_poll_pace_s=5)
    try:
        await futures.open("req-1", "alice", "Sample")
        server.stop(save=True)
        assert await futures.complete("req-1", {"ok": True}) is None
        poll = asyncio.create_task(futures.wait("alice", "req-1", 20))
        await asyncio.sleep(0.1)
        assert not poll.done(), "a poll during the outage waits for the store before answering"
        await asyncio.to_thread(server.start)  # back within the pace: the same poll answers the result
        done = await asyncio.wait_for(poll, 10)
        assert done.state is FutureState.COMPLETE and done.result_value() == {"ok": True}
        server.stop()
        with pytest.raises(StateStoreUnavailable):  # still down after the pace: the 503
            await futures.wait("alice", "req-1", 0.05)
    finally:
        await store.close()
