"""Resuming from a checkpoint and unloading, through the gateway's HTTP surface (mutation survivors:
these paths had no fast test at all, docs/testing.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

OWNER, STRANGER = "tml-owner-key-00001", "tml-stranger-key-01"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, DoubleRuntime]]:
    runtime = DoubleRuntime()
    app = double_app(tmp_path, runtime, {OWNER: "owner", STRANGER: "stranger"}, long_poll_s=0.2)
    async with asgi_client(app) as client:
        yield client, runtime


async def _call(client: httpx.AsyncClient, route: str, key: str = OWNER, **body: Any) -> httpx.Response:
    """POST a Tinker call and wait for its future (polling through `try_again`)."""
    r = await client.post(f"/api/v1/{route}", json=body, headers={"X-API-Key": key})
    if r.status_code != 200:
        return r
    request_id = r.json()["request_id"]
    for _ in range(100):
        r = await client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": key}
        )
        if not (
            r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again"
        ):
            return r
    raise AssertionError(f"{route} never resolved")


async def _trained_model_with_checkpoint(client: httpx.AsyncClient) -> tuple[str, str, str]:
    """(session_id, model_id, weights path): one step at lr 0.5 saved, then a second step not saved."""
    sid = (await client.post("/api/v1/create_session", json={}, headers={"X-API-Key": OWNER})).json()[
        "session_id"
    ]
    created = await _call(
        client, "create_model", session_id=sid, model_seq_id=0, base_model=BASE, lora_config={"rank": 4}
    )
    model_id = created.json()["model_id"]
    await _call(client, "optim_step", model_id=model_id, seq_id=1, adam_params={"learning_rate": 0.5})
    saved = await _call(client, "save_weights", model_id=model_id, seq_id=2, path="after-one-step")
    await _call(client, "optim_step", model_id=model_id, seq_id=3, adam_params={"learning_rate": 0.5})
    return sid, model_id, saved.json()["path"]


async def _logprobs(client: httpx.AsyncClient, model_id: str, seq_id: int) -> list[float]:
    """forward (no update): the double's logprobs are -0.01 * target - (sum of learning rates applied)."""
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": tinker.TensorData(data=[10, 20], dtype="int64", shape=[2])},
    )
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    r = await client.post(
        "/api/v1/forward_backward", content=message.SerializeToString(), headers={"X-API-Key": OWNER}
    )
    request_id = r.json()["request_id"]
    for _ in range(100):
        r = await client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": OWNER}
        )
        if not r.headers["content-type"].startswith("application/json"):
            return deserialize_forward_backward_output(r.content).loss_fn_outputs[0]["logprobs"].tolist()
        assert r.json().get("type") == "try_again", r.text
    raise AssertionError("forward never resolved")


async def test_load_weights_puts_a_model_back_to_its_checkpoint(env) -> None:
    client, runtime = env
    _, model_id, path = await _trained_model_with_checkpoint(client)
    assert await _logprobs(client, model_id, 4) == pytest.approx([-1.1, -1.2])  # two steps in
    loaded = await _call(client, "load_weights", model_id=model_id, seq_id=5, path=path, optimizer=True)
    assert loaded.json()["path"] == path and loaded.json()["model_id"] == model_id
    assert await _logprobs(client, model_id, 6) == pytest.approx([-0.6, -0.7])  # back to one step
    assert runtime.models[model_id]["step"] == 1


async def test_a_checkpoint_becomes_a_new_model_with_its_base_model_and_rank(env) -> None:
    client, runtime = env
    sid, model_id, path = await _trained_model_with_checkpoint(client)
    r = await _call(client, "load_weights", session_id=sid, model_seq_id=1, path=path, optimizer=False)
    resumed = r.json()["model_id"]
    assert resumed == f"{sid}:train:1" and resumed != model_id and r.json()["path"] == path
    assert ("create_model", resumed) in runtime.calls and ("load_state", resumed) in runtime.calls
    info = (
        await client.post("/api/v1/get_info", json={"model_id": resumed}, headers={"X-API-Key": OWNER})
    ).json()
    assert info["model_name"] == BASE and info["is_lora"] and info["lora_rank"] == 4
    assert await _logprobs(client, resumed, 1) == pytest.approx([-0.6, -0.7])


async def test_a_checkpoint_loads_only_for_its_owner_and_only_as_training_weights(env) -> None:
    client, runtime = env
    _, model_id, path = await _trained_model_with_checkpoint(client)
    stranger_sid = (
        await client.post("/api/v1/create_session", json={}, headers={"X-API-Key": STRANGER})
    ).json()["session_id"]
    r = await _call(client, "load_weights", STRANGER, session_id=stranger_sid, model_seq_id=0, path=path)
    assert r.status_code == 404 and path in r.json()["detail"]
    assert not any(m.startswith(stranger_sid) for _, m in runtime.calls)

    snapshot = await _call(client, "save_weights_for_sampler", model_id=model_id, seq_id=4, path="snap")
    failed = await _call(client, "load_weights", model_id=model_id, seq_id=5, path=snapshot.json()["path"])
    assert failed.json()["category"] == "user" and "sampler snapshot" in failed.json()["error"]
    missing = await _call(
        client, "load_weights", model_id=model_id, seq_id=6, path=f"tinker://{model_id}/weights/none"
    )
    assert missing.json()["category"] == "user" and "not found" in missing.json()["error"]
    assert ("load_state", model_id) not in runtime.calls


async def test_unload_releases_the_model_and_forgets_it(env) -> None:
    client, runtime = env
    _, model_id, _ = await _trained_model_with_checkpoint(client)
    assert (await _call(client, "unload_model", STRANGER, model_id=model_id)).status_code == 404
    assert model_id in runtime.models
    r = await _call(client, "unload_model", model_id=model_id)
    assert r.json()["model_id"] == model_id
    assert ("release_model", model_id) in runtime.calls and model_id not in runtime.models
    r = await client.post("/api/v1/get_info", json={"model_id": model_id}, headers={"X-API-Key": OWNER})
    assert r.status_code == 404
