"""retrieve_future's hot path: the first wait on a future this process ran answers from memory, exactly the
record the store holds; every later wait, another tenant's and another process's read the store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.state import StateStore
from miles.state import futures as futures_module
from miles.state.futures import FutureRepository, FutureState

PROTO = b"\x08\x01\x12\x03abc\x00\xff"  # any bytes: a protobuf result travels as base64


class CountingReads:
    """The real store, with its `get` calls counted (what the hot path must not need)."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self.reads = 0

    async def get(self, namespace: str, key: str) -> Any:
        self.reads += 1
        return await self._store.get(namespace, key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def _opened(futures: FutureRepository, tenant: str = "t1") -> str:
    rid = futures.new_request_id()
    await futures.open(rid, tenant, "ForwardBackward", model_id="m")
    return rid


async def test_a_waiter_gets_the_outcome_without_a_store_read_and_equal_to_the_store(store) -> None:
    counting = CountingReads(store)
    futures = FutureRepository(counting, ttl_s=600)  # type: ignore[arg-type]
    rid = await _opened(futures)
    waiter = asyncio.create_task(futures.wait("t1", rid, 10))
    await asyncio.sleep(0.02)
    await futures.mark_running(rid)
    await futures.complete(rid, PROTO)
    answered = await waiter
    assert counting.reads == 0, "the running future and its outcome were answered from memory"
    stored = await futures.get(rid)
    assert answered == stored and answered.state is FutureState.COMPLETE
    assert answered.result_bytes() == PROTO


async def test_after_the_memory_copy_is_taken_waits_read_the_store_and_answer_the_same(store) -> None:
    counting = CountingReads(store)
    futures = FutureRepository(counting, ttl_s=600)  # type: ignore[arg-type]
    rid = await _opened(futures)
    await futures.fail(rid, "bad batch", "user")
    first = await futures.wait("t1", rid, 1)
    assert counting.reads == 0
    second = await futures.wait("t1", rid, 1)
    assert counting.reads > 0, "the memory copy answers once; the store answers after"
    restarted = await FutureRepository(store, ttl_s=600).wait("t1", rid, 1)  # another gateway process
    assert first == second == restarted
    assert second.error is not None and second.error.message == "bad batch"


async def test_another_tenant_neither_sees_nor_takes_the_kept_outcome(store) -> None:
    counting = CountingReads(store)
    futures = FutureRepository(counting, ttl_s=600)  # type: ignore[arg-type]
    rid = await _opened(futures)
    assert await futures.wait("t2", rid, 0.01) is None, "running: not theirs"
    await futures.complete(rid, {"loss": 1.5})
    assert await futures.wait("t2", rid, 0.01) is None, "complete: still not theirs"
    reads = counting.reads
    mine = await futures.wait("t1", rid, 0.01)
    assert counting.reads == reads and mine.result_value() == {"loss": 1.5}


async def test_only_the_newest_outcomes_stay_in_memory_and_older_ones_come_from_the_store(
    store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(futures_module, "MAX_FINISHED_IN_MEMORY", 2)
    counting = CountingReads(store)
    futures = FutureRepository(counting, ttl_s=600)  # type: ignore[arg-type]
    rids = [await _opened(futures) for _ in range(3)]
    for i, rid in enumerate(rids):
        await futures.complete(rid, {"i": i})
    oldest = await futures.wait("t1", rids[0], 0.01)
    assert counting.reads > 0 and oldest.result_value() == {"i": 0}
    reads = counting.reads
    assert [(await futures.wait("t1", rid, 0.01)).result_value() for rid in rids[1:]] == [{"i": 1}, {"i": 2}]
    assert counting.reads == reads
