"""Property-based fuzzing of every gateway route from its own OpenAPI schema (schemathesis + hypothesis).

The gateway runs in-process over the real local runtime (a tiny model, the CPU engine subprocess) on one
event loop in a background thread; hypothesis draws cases in the test's thread. Each case goes out with a
valid API key or without one, and some have their ids replaced by a real session's, model's and future's
so that generated bodies reach the services, not only the 404 of an unknown id. Every answer must be
below 500, arrive within the per-case bound, and be a JSON body when it is an error.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from miles.checkpoints.manager import CheckpointManager
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.settings import GatewaySettings
from miles.runtime.local import LocalRuntime
from miles.state import MemoryStateStore
from miles.utils.http import close_clients

pytestmark = pytest.mark.slow

KEY = "tml-fuzz-tenant-key-0001"
MODEL = "tiny"
CASES_PER_OPERATION = 40  # fewer where an operation has fewer distinct cases (no parameters)
CASE_BOUND_S = 20.0  # a case answered later than this counts as a hang
# ids a generated body may carry: replaced by live ones in some cases
ID_FIELDS = ("session_id", "model_id", "request_id", "sampling_session_id")


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    not_json: list[str] = field(default_factory=list)


class LoopThread:
    """An event loop in a thread: the gateway, its runtime and the client all live on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class FuzzTarget:
    loop: LoopThread
    client: httpx.AsyncClient
    schema: Any
    live_ids: dict[str, str]


async def _live_objects(client: httpx.AsyncClient) -> dict[str, str]:
    """A session, a LoRA model, a sampler and a finished future of the fuzzing tenant."""
    headers = {"X-API-Key": KEY}
    session = (await client.post("/api/v1/create_session", json={}, headers=headers)).json()["session_id"]
    created = await client.post(
        "/api/v1/create_model",
        json={"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}},
        headers=headers,
    )
    model_id, request_id = created.json()["model_id"], created.json()["request_id"]
    done = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
    assert done.status_code == 200 and done.json()["model_id"] == model_id, done.text
    sampler = await client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
        headers=headers,
    )
    return {
        "session_id": session,
        "model_id": model_id,
        "request_id": request_id,
        "sampling_session_id": sampler.json()["sampling_session_id"],
    }


@pytest.fixture(scope="module")
def fuzz_target(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    loop = LoopThread()
    runtime = loop.run(LocalRuntime.start(tiny_model_dir, model_name=MODEL), timeout=240)
    store = MemoryStateStore()
    checkpoints = CheckpointManager(tmp_path_factory.mktemp("fuzz-ckpt"), store)
    # short long-poll and gap timeouts: a fuzzed retrieve_future or seq_id must not hold a case for long
    app = create_app(
        runtime,
        store,
        checkpoints,
        ApiKeys({KEY: "fuzzer"}),
        GatewaySettings(long_poll_s=1.0, seq_gap_timeout_s=5.0, max_body_bytes=1 << 20),
    )
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer to count
    client = loop.run(_make_client(transport), timeout=10)
    try:
        live = loop.run(_live_objects(client), timeout=120)
        schema = schemathesis.openapi.from_dict(app.openapi())
        yield FuzzTarget(loop, client, schema, live)
    finally:
        loop.run(_shutdown(app, client, runtime), timeout=60)
        loop.stop()


async def _make_client(transport: httpx.ASGITransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=CASE_BOUND_S)


async def _shutdown(app: Any, client: httpx.AsyncClient, runtime: LocalRuntime) -> None:
    await client.aclose()
    await app.state.gateway.ops.close()
    await runtime.close()
    await close_clients()


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _cases(operation: Any) -> st.SearchStrategy[Any]:
    """One operation's cases, in valid (positive) and schema-violating (negative) shapes."""
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return st.one_of([operation.as_strategy(generation_mode=mode) for mode in modes])


def _request_of(case: Any, with_key: bool, live: dict[str, str] | None) -> dict[str, Any]:
    kwargs = case.as_transport_kwargs(base_url="http://gw")
    headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() not in ("x-api-key",)}
    headers.pop("Authorization", None)
    if with_key:
        headers.update({"X-API-Key": KEY, "Authorization": f"Bearer {KEY}"})
    kwargs["headers"] = headers
    body = kwargs.get("json")
    if live is not None and isinstance(body, dict):
        kwargs["json"] = {k: live.get(k, v) for k, v in body.items()}
    return kwargs


async def _send(client: httpx.AsyncClient, kwargs: dict[str, Any]) -> httpx.Response:
    allowed = ("method", "url", "headers", "params", "json", "content", "data", "cookies")
    return await asyncio.wait_for(
        client.request(**{k: v for k, v in kwargs.items() if k in allowed}), CASE_BOUND_S
    )


def _check(tally: Tally, label: str, response: httpx.Response) -> None:
    tally.statuses[response.status_code] += 1
    if response.status_code >= 500:
        tally.server_errors.append(f"{label} -> {response.status_code} {response.text[:200]}")
    if response.status_code >= 400:
        try:
            json.loads(response.content)
        except ValueError:
            tally.not_json.append(f"{label} -> {response.status_code} {response.text[:100]!r}")


def _fuzz_operation(target: FuzzTarget, operation: Any, tally: Tally) -> None:
    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases on every run: a failure here reproduces
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(operation), with_key=st.booleans(), use_live=st.booleans())
    def one_case(case: Any, with_key: bool, use_live: bool) -> None:
        kwargs = _request_of(case, with_key, target.live_ids if use_live else None)
        label = f"{kwargs['method']} {case.formatted_path} key={with_key} live={use_live}"
        tally.operations[operation.label] += 1
        try:
            response = target.loop.run(_send(target.client, kwargs), timeout=CASE_BOUND_S + 5)
        except (TimeoutError, FutureTimeout):
            tally.hangs.append(label)
            return
        _check(tally, label, response)

    one_case()


def test_every_route_survives_generated_requests_with_and_without_a_key(fuzz_target: FuzzTarget) -> None:
    tally = Tally()
    operations = _operations(fuzz_target.schema)
    for operation in operations:
        _fuzz_operation(fuzz_target, operation, tally)
    sent = sum(tally.statuses.values())
    statuses = dict(sorted(tally.statuses.items()))
    print(f"fuzz: {sent} cases over {len(operations)} operations, statuses {statuses}")
    assert sent + len(tally.hangs) >= 1000
    assert sorted(tally.operations) == sorted(op.label for op in operations)  # every route was fuzzed
    assert tally.server_errors == []
    assert tally.hangs == []
    assert tally.not_json == []
    # both sides of the key were fuzzed: unauthenticated cases were refused, keyed ones got past auth
    assert tally.statuses[401] > 0 and sum(n for s, n in tally.statuses.items() if s < 300) > 0
