"""A gateway restarted on Redis still knows sessions, models, finished futures and checkpoints; an
operation in flight when the gateway process was killed fails with a restart error instead of hanging."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from bench.gateway_process import BASE_MODEL, start_gateway
from miles.state import open_state_store
from miles.state.futures import FutureRecord, FutureRepository, FutureState

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY_A = "tml-restart-alpha-0001"
KEY_B = "tml-restart-bravo-0002"
KEYS = {KEY_A: "alpha", KEY_B: "bravo"}


def _post(url: str, path: str, body: dict, key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"X-API-Key": key}, timeout=60)


def _await_future(url: str, request_id: str) -> httpx.Response:
    for _ in range(30):
        r = _post(url, "/api/v1/retrieve_future", {"request_id": request_id})
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError(f"future {request_id} never resolved")


def test_restart_on_redis_keeps_sessions_models_futures_and_checkpoints(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    flags = (
        "--state-url",
        redis_url,
        "--state-key-prefix",
        f"gw-{uuid.uuid4().hex[:8]}",
        "--long-poll-s",
        "3",
    )
    first = start_gateway(tiny_model_dir, tmp_path, KEYS, *flags)
    try:
        service = tinker.ServiceClient(base_url=first.url, api_key=KEY_A)
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        polls = [r for r in first.requests() if r["headers"].get("x-tinker-request-type") == "OptimStep"]
        step_id = polls[-1]["json"]["request_id"]
        finished = _await_future(first.url, step_id).json()
        assert "metrics" in finished
        state_path = tc.save_state("before-restart").result().path
        want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    finally:
        first.stop()

    session_id = tc.model_id.split(":")[0]
    second = start_gateway(tiny_model_dir, tmp_path, KEYS, *flags)
    try:
        url = second.url
        assert _post(url, "/api/v1/session_heartbeat", {"session_id": session_id}).status_code == 200
        info = _post(url, "/api/v1/get_info", {"model_id": tc.model_id}).json()
        assert info["model_id"] == tc.model_id and info["lora_rank"] == 4
        again = _await_future(url, step_id)
        assert again.json() == finished
        # The SDK retrying its optim_step against the restarted gateway: the dedup claim in Redis hands
        # back the first submission's future (the same result), and no second step runs.
        (submitted,) = [r for r in first.requests() if r["path"] == "/api/v1/optim_step"]
        replay = _post(url, "/api/v1/optim_step", submitted["json"])
        assert replay.status_code == 200 and replay.json()["request_id"] == step_id
        assert _await_future(url, replay.json()["request_id"]).json() == finished
        assert _post(url, "/api/v1/weights_info", {"tinker_path": state_path}).json()["lora_rank"] == 4
        run = httpx.get(f"{url}/api/v1/training_runs/{tc.model_id}", headers={"X-API-Key": KEY_A}).json()
        assert run["last_checkpoint"]["tinker_path"] == state_path
        for path, body in (
            ("/api/v1/get_info", {"model_id": tc.model_id}),
            ("/api/v1/weights_info", {"tinker_path": state_path}),
        ):
            assert _post(url, path, body, key=KEY_B).status_code == 404
        # The restarted runtime resumes training from the checkpoint the old process wrote.
        resumed = tinker.ServiceClient(base_url=url, api_key=KEY_A).create_training_client_from_state(
            state_path
        )
        got = (
            resumed.result()
            .forward([datum], "cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        second.stop()
    time.sleep(0)


def _future_in_store(redis_url: str, prefix: str, request_id: str) -> FutureRecord | None:
    async def read() -> FutureRecord | None:
        store = open_state_store(redis_url, key_prefix=prefix)
        try:
            return await FutureRepository(store).get(request_id)
        finally:
            await store.close()

    return asyncio.run(read())


def _queued_forward_backward(url: str, model_id: str, datum: types.Datum) -> str:
    """A forward_backward at a seq_id far past the model's next one: it waits in the model's queue for
    the missing ones (seq_gap_timeout_s, 120 s), so it is certainly in flight when the gateway dies."""
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=1000,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    headers = {"X-API-Key": KEY_A, "Content-Type": "application/x-protobuf"}
    r = httpx.post(f"{url}/api/v1/forward_backward", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def test_an_operation_in_flight_when_the_gateway_is_killed_fails_with_a_restart_error(
    tiny_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    prefix = f"gw-{uuid.uuid4().hex[:8]}"
    flags = ("--state-url", redis_url, "--state-key-prefix", prefix, "--long-poll-s", "3")
    first = start_gateway(tiny_model_dir, tmp_path, KEYS, *flags)
    try:
        service = tinker.ServiceClient(base_url=first.url, api_key=KEY_A)
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        state_path = tc.save_state("before-kill").result().path
        in_flight = _queued_forward_backward(first.url, tc.model_id, datum)
        pending = _future_in_store(redis_url, prefix, in_flight)
        assert pending is not None and pending.state is FutureState.PENDING, pending
    finally:
        first.proc.kill()  # SIGKILL: no shutdown path runs, the future stays PENDING in Redis
        first.proc.wait(timeout=30)
    assert _future_in_store(redis_url, prefix, in_flight).state is FutureState.PENDING

    second = start_gateway(tiny_model_dir, tmp_path, KEYS, *flags)
    try:
        r = _post(second.url, "/api/v1/retrieve_future", {"request_id": in_flight})  # not try_again
        assert r.status_code == 200 and r.json()["error"] == FutureRepository.RESTARTED, r.text
        assert r.json()["category"] == "server"
        assert _post(second.url, "/api/v1/retrieve_future", {"request_id": in_flight}).json() == r.json()
        # Sessions, models and checkpoints written before the kill are all there.
        session_id = tc.model_id.split(":")[0]
        assert _post(second.url, "/api/v1/session_heartbeat", {"session_id": session_id}).status_code == 200
        assert _post(second.url, "/api/v1/get_info", {"model_id": tc.model_id}).json()["lora_rank"] == 4
        assert _post(second.url, "/api/v1/weights_info", {"tinker_path": state_path}).json()["lora_rank"] == 4
    finally:
        second.stop()
