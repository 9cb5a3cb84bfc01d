"""Tenant isolation on every route: tenant A naming tenant B's session, model, future, sampler, checkpoint
or OpenAI model name gets exactly the answer it gets for an id that names nothing (no existence leak).

B's objects are real (made through the API); the "missing" twin of each request is the same request with
B's session id and request id swapped for well-formed ids nobody has, which changes every id derived
from them (model ids, sampler ids, tinker:// paths) consistently.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker.proto import tinker_public_pb2 as pb

from miles.gateway.auth import ApiKeys

KEY_A = "tml-tenant-a-key-0001"
KEY_B = "tml-tenant-b-key-0002"
A = {"X-API-Key": KEY_A}
B = {"X-API-Key": KEY_B}


async def _done(client: httpx.AsyncClient, request_id: str, headers: dict[str, str]) -> dict[str, Any]:
    response = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


async def _tenant_b_objects(client: httpx.AsyncClient) -> dict[str, str]:
    session = (await client.post("/api/v1/create_session", json={}, headers=B)).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 1}}
    created = (await client.post("/api/v1/create_model", json=body, headers=B)).json()
    model_id = created["model_id"]
    await _done(client, created["request_id"], B)
    saved = await client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "w1"}, headers=B)
    weights = (await _done(client, saved.json()["request_id"], B))["path"]
    body = {"model_id": model_id, "path": "s1", "sampling_session_seq_id": 1}
    snap = await client.post("/api/v1/save_weights_for_sampler", json=body, headers=B)
    snapshot = await _done(client, snap.json()["request_id"], B)
    return {
        "session": session,
        "model": model_id,
        "request": created["request_id"],
        "sampler": snapshot["sampling_session_id"],
        "weights": weights,
        "snapshot": snapshot["path"],
    }


def _requests(o: dict[str, str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx keyword arguments) of every route that names one of B's objects."""
    model, session = o["model"], o["session"]
    ckpt = o["weights"].split(f"{model}/", 1)[1]
    prompt = {"chunks": [{"tokens": [1, 2]}]}
    fwd = pb.ForwardBackwardRequest(model_id=model, seq_id=1, loss_fn="cross_entropy")
    datum = fwd.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(2, dtype="<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.arange(2, dtype="<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[2])
    )
    proto = {"content": fwd.SerializeToString(), "headers": {"Content-Type": "application/x-protobuf"}}
    return [
        ("POST", "/api/v1/session_heartbeat", {"json": {"session_id": session}}),
        ("GET", f"/api/v1/sessions/{session}", {}),
        (
            "POST",
            "/api/v1/create_model",
            {"json": {"session_id": session, "model_seq_id": 5, "base_model": BASE}},
        ),
        (
            "POST",
            "/api/v1/create_sampling_session",
            {"json": {"session_id": session, "sampling_session_seq_id": 5, "base_model": BASE}},
        ),
        (
            "POST",
            "/api/v1/load_weights",
            {"json": {"session_id": session, "model_seq_id": 6, "path": o["weights"]}},
        ),
        ("POST", "/api/v1/get_info", {"json": {"model_id": model}}),
        ("POST", "/api/v1/unload_model", {"json": {"model_id": model}}),
        ("POST", "/api/v1/forward_backward", proto),
        ("POST", "/api/v1/optim_step", {"json": {"model_id": model, "seq_id": 1, "adam_params": {}}}),
        ("POST", "/api/v1/save_weights", {"json": {"model_id": model, "path": "x"}}),
        ("POST", "/api/v1/save_weights_for_sampler", {"json": {"model_id": model, "path": "x"}}),
        ("POST", "/api/v1/save_weights_external", {"json": {"model_id": model, "path": "x"}}),
        ("POST", "/api/v1/load_weights", {"json": {"model_id": model, "path": o["weights"]}}),
        ("GET", f"/api/v1/training_runs/{model}", {}),
        ("GET", f"/api/v1/training_runs/{model}/checkpoints", {}),
        ("DELETE", f"/api/v1/training_runs/{model}/checkpoints/{ckpt}", {}),
        ("PUT", f"/api/v1/training_runs/{model}/checkpoints/{ckpt}/ttl", {"json": {"ttl_seconds": 60}}),
        ("POST", f"/api/v1/training_runs/{model}/checkpoints/{ckpt}/publish", {}),
        ("GET", f"/api/v1/training_runs/{model}/checkpoints/{ckpt}/external_weights_urls", {}),
        ("POST", "/api/v1/weights_info", {"json": {"tinker_path": o["weights"]}}),
        ("POST", "/api/v1/retrieve_future", {"json": {"request_id": o["request"]}}),
        ("GET", f"/api/v1/samplers/{o['sampler']}", {}),
        (
            "POST",
            "/api/v1/asample",
            {"json": {"sampling_session_id": o["sampler"], "prompt": prompt, "sampling_params": {}}},
        ),
        (
            "POST",
            "/api/v1/asample",
            {"json": {"model_path": o["snapshot"], "prompt": prompt, "sampling_params": {}}},
        ),
        (
            "POST",
            "/api/v1/create_sampling_session",
            {"json": {"session_id": session, "sampling_session_seq_id": 7, "model_path": o["snapshot"]}},
        ),
        ("POST", "/v1/completions", {"json": {"model": o["snapshot"], "prompt": "hi", "max_tokens": 2}}),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": o["snapshot"], "messages": [{"role": "user", "content": "hi"}]}},
        ),
        ("POST", f"/api/v1/sessions/{session}/finish", {"json": {}}),  # last: it ends B's session
    ]


def _swap(value: Any, swaps: dict[str, str]) -> Any:
    if isinstance(value, str):
        for old, new in swaps.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, bytes):
        for old, new in swaps.items():
            value = value.replace(old.encode(), new.encode())
        return value
    if isinstance(value, dict):
        return {k: _swap(v, swaps) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap(v, swaps) for v in value]
    return value


async def _send(client: httpx.AsyncClient, method: str, path: str, kwargs: dict[str, Any]) -> httpx.Response:
    headers = {**kwargs.get("headers", {}), **A, "Authorization": f"Bearer {KEY_A}"}
    return await client.request(method, path, **{**kwargs, "headers": headers})


async def _outcome(client: httpx.AsyncClient, response: httpx.Response) -> tuple[int, str]:
    """The status and body; for an accepted operation, its future's result as A sees it."""
    if response.status_code == 200 and "request_id" in response.text:
        future = await client.post(
            "/api/v1/retrieve_future", json={"request_id": response.json()["request_id"]}, headers=A
        )
        return future.status_code, future.text
    return response.status_code, response.text


async def test_another_tenants_objects_answer_exactly_like_missing_ones(tmp_path: Path) -> None:
    app = double_app(tmp_path, DoubleRuntime(), {KEY_A: "tenant-a", KEY_B: "tenant-b"})
    async with asgi_client(app) as client:
        # A has a model of its own, so routes that need one reach B's checkpoint path
        own = await _tenant_b_objects_as(client, A)
        objects = await _tenant_b_objects(client)
        missing = {objects["session"]: "sess-" + "0" * 20, objects["request"]: "req-" + "0" * 32}
        for method, path, kwargs in _requests(objects):
            if path == "/api/v1/load_weights" and "model_id" in kwargs.get("json", {}):
                kwargs = {"json": {**kwargs["json"], "model_id": own["model"]}}
            real = await _outcome(client, await _send(client, method, path, kwargs))
            twin = await _outcome(
                client, await _send(client, method, _swap(path, missing), _swap(kwargs, missing))
            )
            unswap = {new: old for old, new in missing.items()}
            assert real == (twin[0], _swap(twin[1], unswap)), (method, path, real, twin)
            assert real[0] >= 400 or "error" in real[1], (method, path, real)  # refused, one way or another
        # listings show A nothing of B's
        for path in ("/api/v1/training_runs", "/api/v1/checkpoints", "/api/v1/sessions", "/v1/models"):
            listing = await _send(client, "GET", path, {})
            assert listing.status_code == 200 and objects["session"] not in listing.text, (path, listing.text)
        # and B still has everything A named (A's calls changed nothing of B's)
        info = await client.post("/api/v1/get_info", json={"model_id": objects["model"]}, headers=B)
        assert info.status_code == 200, info.text
        ckpts = await client.get(f"/api/v1/training_runs/{objects['model']}/checkpoints", headers=B)
        assert objects["weights"] in ckpts.text


async def _tenant_b_objects_as(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, str]:
    session = (await client.post("/api/v1/create_session", json={}, headers=headers)).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 1}}
    created = (await client.post("/api/v1/create_model", json=body, headers=headers)).json()
    await _done(client, created["request_id"], headers)
    return {"session": session, "model": created["model_id"]}


def test_api_keys_are_compared_in_constant_time_over_every_key(monkeypatch) -> None:
    """Every presented key is compared (hmac.compare_digest) against every known key, whatever matches."""
    keys = ApiKeys({KEY_A: "a", KEY_B: "b"})
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(x: bytes, y: bytes) -> bool:
        calls.append((x, y))
        return real(x, y)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert keys.tenant_for(KEY_A) == "a" and keys.tenant_for("tml-nobody-000000") is None
    assert keys.tenant_for("tml-t\u00e9nant-\u00e9") is None  # non-ASCII: compared as bytes, no TypeError
    assert len(calls) == 6  # 3 lookups x 2 keys: a match does not stop the scan
