"""Seq ordering, gap timeouts, futures by event, dedup claims and failure mapping."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.gateway.errors import ApiError
from miles.gateway.futures import FutureRegistry, FutureStatus, IllegalTransition
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.ordering import SeqQueue
from miles.gateway.settings import GatewaySettings
from miles.state import MemoryStateStore
from miles.types import UserError


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


async def test_future_wait_wakes_on_completion_and_times_out_otherwise() -> None:
    store = MemoryStateStore()
    futures = FutureRegistry(store, ttl_s=60)
    rid = await futures.create("t1", "OptimStep", model_id="m")
    view = await futures.wait("t1", rid, 0.05)
    assert view.status is FutureStatus.PENDING
    waiter = asyncio.create_task(futures.wait("t1", rid, 10))
    await asyncio.sleep(0.01)
    done_at = time.monotonic()
    await futures.complete_json(rid, {"metrics": {"x": float("nan")}})
    view = await waiter
    assert time.monotonic() - done_at < 0.5
    assert view.status is FutureStatus.COMPLETE and "NaN" in (view.result_json or "")
    with pytest.raises(IllegalTransition):
        await futures.fail(rid, "late", "server")
    with pytest.raises(ApiError) as err:
        await futures.get("t2", rid)
    assert err.value.status == 404


async def test_future_of_a_previous_gateway_process_fails_with_resubmit_hint() -> None:
    store = MemoryStateStore()
    old = FutureRegistry(store, ttl_s=60, instance_id="old")
    rid = await old.create("t", "ForwardBackward")
    new = FutureRegistry(store, ttl_s=60, instance_id="new")
    view = await new.wait("t", rid, 1)
    assert view.status is FutureStatus.FAILED and "submit it again" in (view.error or "")


def _ops(**overrides) -> tuple[Operations, FutureRegistry]:
    store = MemoryStateStore()
    futures = FutureRegistry(store, ttl_s=60)
    settings = GatewaySettings(**overrides)
    return Operations(store, futures, settings, GatewayMetrics()), futures


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
    view = await futures.wait("t", first, 5)
    assert view.status is FutureStatus.COMPLETE and calls == 1
    other_tenant = await ops.submit_ordered(seq_id=1, idempotency_key="k1", **{**kw, "tenant": "u"})
    assert other_tenant != first
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
    views = [await futures.wait("t", rid, 5) for rid in ids]
    assert [v.category for v in views] == ["user", "server", "server"]
    assert views[0].error.startswith("loss_fn 'nope'")
    assert views[1].error == "RuntimeError: engine exploded"
    assert "longer than" in views[2].error
    await ops.close()
