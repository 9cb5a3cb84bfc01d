"""A gateway restarted on Redis still knows sessions, models, finished futures and checkpoints."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from gateway_process import BASE_MODEL, start_gateway
from tinker import types

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
