"""Seq ordering, gap timeouts, futures by event, dedup claims and failure mapping."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.errors import Category, IllegalTransition, UserError
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.ordering import SeqQueue
from miles.gateway.settings import GatewaySettings
from miles.state import MemoryStateStore
from miles.state.claims import DedupClaims
from miles.state.futures import FutureRepository, FutureState


async def test_jobs_run_in_seq_order_whatever_the_arrival_order() -> None:
    queue = SeqQueue("m", first_seq=1, gap_timeout_s=5)
    ran: list[int] = []
    rejected: list[str] = []

    def job(n: int):
        async def run() -> None:
            await asyncio.sleep(0)
            ran.append(n)

        return run

    async def reject(msg: str) -> None:
        rejected.append(msg)

    for seq in (3, 5, 2, 4, 1):
        await queue.submit(seq, job(seq), reject)
    for _ in range(50):
        if len(ran) == 5:
            break
        await asyncio.sleep(0.01)
    assert ran == [1, 2, 3, 4, 5]
    await queue.submit(2, job(99), reject)
    assert rejected and "next expected seq_id is 6" in rejected[0]
    await queue.close("done")


async def test_a_gap_fails_the_waiting_ops_clearly_and_the_queue_moves_on() -> None:
    queue = SeqQueue("m", first_seq=1, gap_timeout_s=0.2)
    ran: list[int] = []
    rejected: list[str] = []

    async def reject(msg: str) -> None:
        rejected.append(msg)

    def job(n: int):
        async def run() -> None:
            ran.append(n)

        return run

    await queue.submit(2, job(2), reject)
    await queue.submit(3, job(3), reject)
    await asyncio.sleep(0.5)
    assert ran == []
    assert len(rejected) == 2 and "seq_id 1, which never arrived" in rejected[0]
    await queue.submit(4, job(4), reject)
    await asyncio.sleep(0.05)
    assert ran == [4]
    await queue.close("done")


async def test_a_refused_seq_id_is_skipped_so_the_next_runs_without_waiting_out_the_gap() -> None:
    queue = SeqQueue("m", first_seq=1, gap_timeout_s=30)
    ran: list[int] = []
    rejected: list[str] = []

    async def reject(msg: str) -> None:
        rejected.append(msg)

    def job(n: int):
        async def run() -> None:
            ran.append(n)

        return run

    await queue.submit(2, job(2), reject)
    await asyncio.sleep(0.05)
    assert ran == []  # waits for 1
    assert queue.skip(1)
    await asyncio.sleep(0.05)
    assert ran == [2]
    assert queue.skip(4)  # refused before 3 arrived: 5 runs right after 3
    await queue.submit(3, job(3), reject)
    await queue.submit(5, job(5), reject)
    await asyncio.sleep(0.05)
    assert ran == [2, 3, 5]
    assert not queue.skip(5) and not queue.skip(1)  # taken seq_ids are never skipped
    assert queue.skip(7)
    await queue.submit(7, job(7), reject)  # a real operation at a skipped seq_id still runs
    await queue.submit(6, job(6), reject)
    await asyncio.sleep(0.05)
    assert ran == [2, 3, 5, 6, 7] and rejected == []
    await queue.close("done")


async def test_future_wait_wakes_on_completion_and_times_out_otherwise() -> None:
    store = MemoryStateStore()
    futures = FutureRepository(store, ttl_s=60)
    rid = futures.new_request_id()
    await futures.open(rid, "t1", "OptimStep", model_id="m")
    record = await futures.wait("t1", rid, 0.05)
    assert record.state is FutureState.PENDING and futures.pending_count() == 1
    waiter = asyncio.create_task(futures.wait("t1", rid, 10))
    await asyncio.sleep(0.01)
    done_at = time.monotonic()
    await futures.complete(rid, {"metrics": {"x": float("nan")}})
    record = await waiter
    assert time.monotonic() - done_at < 0.5
    assert record.state is FutureState.COMPLETE and "NaN" in (record.result_json or "")
    assert futures.pending_count() == 0
    with pytest.raises(IllegalTransition):
        await futures.fail(rid, "late", "server")
    assert await futures.wait("t2", rid, 0.01) is None, "another tenant's future is not there"


async def test_future_of_a_previous_gateway_process_fails_with_resubmit_hint() -> None:
    store = MemoryStateStore()
    old = FutureRepository(store, ttl_s=60, owner="old")
    await old.open("req-1", "t", "ForwardBackward")
    new = FutureRepository(store, ttl_s=60, owner="new")
    record = await new.wait("t", "req-1", 1)
    assert record.state is FutureState.FAILED and "submit it again" in record.error.message
    assert record.error.category == "server"


def _ops(**overrides) -> tuple[Operations, FutureRepository]:
    store = MemoryStateStore()
    futures = FutureRepository(store, ttl_s=60)
    settings = GatewaySettings(**overrides)
    return Operations(futures, DedupClaims(store), settings, GatewayMetrics()), futures


async def test_duplicate_submits_get_the_original_request_id_and_run_once() -> None:
    ops, futures = _ops()
    calls = 0

    async def op() -> dict:
        nonlocal calls
        calls += 1
        return {"n": calls}

    kw = dict(tenant="t", kind="OptimStep", model_id="m", operation=op)
    first = await ops.submit_ordered(seq_id=0, idempotency_key="k1", **kw)
    again_seq = await ops.submit_ordered(seq_id=0, idempotency_key="k2", **kw)
    again_key = await ops.submit_ordered(seq_id=None, idempotency_key="k1", **kw)
    assert first == again_seq == again_key
    record = await futures.wait("t", first, 5)
    assert record.state is FutureState.COMPLETE and calls == 1
    other_tenant = await ops.submit_ordered(seq_id=1, idempotency_key="k1", **{**kw, "tenant": "u"})
    assert other_tenant != first, "idempotency keys are per tenant"
    await ops.close()


async def test_failures_carry_category_and_cause_without_traceback() -> None:
    ops, futures = _ops(execution_timeout_s=0.2)

    async def user_bad() -> dict:
        raise UserError("loss_fn 'nope' is not supported; use one of cross_entropy, ppo")

    async def server_bad() -> dict:
        raise RuntimeError("engine exploded\nTraceback (most recent call last): ...")

    async def slow() -> dict:
        await asyncio.sleep(5)
        return {}

    ids = [
        await ops.submit_ordered(
            tenant="t", kind=k, model_id="m", seq_id=i, idempotency_key=None, operation=fn
        )
        for i, (k, fn) in enumerate([("a", user_bad), ("b", server_bad), ("c", slow)])
    ]
    errors = [(await futures.wait("t", rid, 5)).error for rid in ids]
    assert [e.category for e in errors] == [Category.USER, Category.SERVER, Category.TIMEOUT]
    assert [e.category.reported for e in errors] == ["user", "server", "server"]  # what the SDK is told
    assert errors[0].message.startswith("loss_fn 'nope'")
    assert errors[1].message == "RuntimeError: engine exploded"
    assert "longer than" in errors[2].message
    await ops.close()


async def test_racing_duplicate_submits_share_one_future_and_run_once() -> None:
    ops, futures = _ops()
    calls = 0

    async def op() -> dict:
        nonlocal calls
        calls += 1
        return {}

    ids = await asyncio.gather(
        *(
            ops.submit_ordered(
                tenant="t", kind="OptimStep", model_id="m", seq_id=0, idempotency_key="k", operation=op
            )
            for _ in range(8)
        )
    )
    assert len(set(ids)) == 1
    assert (await futures.wait("t", ids[0], 5)).state is FutureState.COMPLETE and calls == 1
    assert [f.request_id for f in await futures.list()] == [ids[0]], "losers leave no stray future"
    await ops.close()


async def test_release_lets_the_running_op_finish_refuses_queued_ones_then_releases() -> None:
    ops, futures = _ops()
    started, gate = asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def slow() -> dict:
        started.set()
        await gate.wait()
        events.append("op done")
        return {}

    async def never() -> dict:
        events.append("queued op ran")
        return {}

    async def release(model_id: str) -> None:
        events.append(f"released {model_id}")

    kw = dict(tenant="t", kind="OptimStep", model_id="m", idempotency_key=None)
    running = await ops.submit_ordered(seq_id=0, operation=slow, **kw)
    queued = await ops.submit_ordered(seq_id=1, operation=never, **kw)
    await started.wait()
    task = ops.release_model("m", "session s has ended; its models were released", release)
    await asyncio.sleep(0.05)
    assert events == [], "the release waits for the running operation"
    gate.set()
    await task
    assert events == ["op done", "released m"]
    assert (await futures.wait("t", running, 1)).state is FutureState.COMPLETE
    refused = await futures.wait("t", queued, 1)
    assert refused.state is FutureState.FAILED and "session s has ended" in refused.error.message
    assert not ops.has_queue("m")
    await ops.close()
