"""The gateway says when its execution timeout cut an operation (Operations' `on_timeout`, which the app
wires to the runtime's optional `operation_timed_out`): only for a cut, never for an operation that ends
inside the limit or fails with a TimeoutError of its own."""

from __future__ import annotations

import asyncio

from miles.errors import Category
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.settings import GatewaySettings
from miles.seam.runtime import report_operation_timeout
from miles.state import MemoryStateStore
from miles.state.claims import DedupClaims
from miles.state.futures import FutureRepository, FutureState

LIMIT_S = 0.3


def _ops(heard: list[tuple[str, str, str]]) -> tuple[Operations, FutureRepository]:
    store = MemoryStateStore()
    futures = FutureRepository(store, ttl_s=60)
    settings = GatewaySettings(execution_timeout_s=LIMIT_S)
    hook = lambda *signal: heard.append(signal)  # noqa: E731
    return Operations(futures, DedupClaims(store), settings, GatewayMetrics(), on_timeout=hook), futures


def _sleeping(seconds: float):
    async def op() -> dict:
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    return op


async def _run(ops: Operations, futures: FutureRepository, model_id: str, seq_id: int, op) -> object:
    request_id = await ops.submit_ordered(
        tenant="t",
        kind="ForwardBackward",
        model_id=model_id,
        seq_id=seq_id,
        idempotency_key=None,
        operation=op,
    )
    return await futures.wait("t", request_id, 5)


async def test_an_operation_cut_at_the_execution_timeout_is_reported_with_its_model_and_cause() -> None:
    heard: list[tuple[str, str, str]] = []
    ops, futures = _ops(heard)
    record = await _run(ops, futures, "m-slow", 0, _sleeping(5))
    assert record.state is FutureState.FAILED and record.error.category is Category.TIMEOUT
    assert heard == [
        ("m-slow", "ForwardBackward", "ForwardBackward on m-slow ran past the execution timeout (0.3 s)")
    ]
    await ops.close()


async def test_an_operation_inside_the_limit_or_failing_with_its_own_timeout_is_not_reported() -> None:
    heard: list[tuple[str, str, str]] = []
    ops, futures = _ops(heard)
    inside = await _run(ops, futures, "m", 0, _sleeping(LIMIT_S / 3))  # slow, but inside the limit
    assert inside.state is FutureState.COMPLETE

    async def own_timeout() -> dict:  # e.g. a runtime's own bounded wait giving up: not the gateway's cut
        await asyncio.wait_for(asyncio.sleep(5), 0.01)
        return {}

    failed = await _run(ops, futures, "m", 1, own_timeout)
    assert failed.state is FutureState.FAILED and failed.error.category is Category.SERVER
    assert failed.error.message == "TimeoutError"
    assert heard == []
    await ops.close()


async def test_a_runtime_without_the_optional_method_is_left_alone_and_one_with_it_hears() -> None:
    class OneModel:  # a runtime of one model: nothing to quarantine, no method
        pass

    class Catalog:
        def __init__(self) -> None:
            self.heard: list[tuple[str, str, str]] = []

        def operation_timed_out(self, model_id: str, operation: str, cause: str) -> None:
            self.heard.append((model_id, operation, cause))

    report_operation_timeout(OneModel(), "m", "OptimStep", "cut")  # type: ignore[arg-type]
    catalog = Catalog()
    report_operation_timeout(catalog, "m", "OptimStep", "cut")  # type: ignore[arg-type]
    assert catalog.heard == [("m", "OptimStep", "cut")]
