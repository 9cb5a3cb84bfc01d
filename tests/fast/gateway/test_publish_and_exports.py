"""Publishing, external weights exports with signed downloads, the user's checkpoint / session listings and
get_info's arch, through the gateway's HTTP surface over the runtime double. Responses are validated with
the tinker SDK's own response models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker import types as tt

from miles.gateway.services.checkpoints import CheckpointService
from miles.runtime.model_config import model_arch

OWNER, STRANGER = "tml-owner-key-00001", "tml-stranger-key-01"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, DoubleRuntime]]:
    runtime = DoubleRuntime()
    app = double_app(tmp_path, runtime, {OWNER: "owner", STRANGER: "stranger"}, long_poll_s=0.2)
    async with asgi_client(app) as client:
        client.app = app  # type: ignore[attr-defined]
        yield client, runtime


def _h(key: str) -> dict[str, str]:
    return {"X-API-Key": key}


async def _call(client: httpx.AsyncClient, route: str, key: str = OWNER, **body: Any) -> httpx.Response:
    """POST a Tinker call and wait for its future (polling through `try_again`)."""
    r = await client.post(f"/api/v1/{route}", json=body, headers=_h(key))
    if r.status_code != 200:
        return r
    request_id = r.json()["request_id"]
    for _ in range(100):
        r = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=_h(key))
        if not (
            r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again"
        ):
            return r
    raise AssertionError(f"{route} never resolved")


async def _session(client: httpx.AsyncClient, key: str, **meta: str) -> str:
    r = await client.post("/api/v1/create_session", json={"user_metadata": meta}, headers=_h(key))
    return r.json()["session_id"]


async def _model(client: httpx.AsyncClient, key: str = OWNER) -> tuple[str, str]:
    sid = await _session(client, key)
    created = await _call(
        client, "create_model", key, session_id=sid, model_seq_id=0, base_model=BASE, lora_config={"rank": 4}
    )
    return sid, created.json()["model_id"]


def _rest(path: str) -> str:
    """tinker://model/kind/name -> the REST checkpoint route of it."""
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    return f"/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}"


# ---- publishing ------------------------------------------------------------------------------------


async def test_a_published_checkpoint_is_readable_by_other_tenants_until_unpublished(env) -> None:
    client, runtime = env
    _, model_id = await _model(client)
    await _call(client, "optim_step", model_id=model_id, seq_id=1, adam_params={"learning_rate": 0.5})
    weights = (await _call(client, "save_weights", model_id=model_id, seq_id=2, path="w")).json()["path"]
    snap = await _call(client, "save_weights_for_sampler", model_id=model_id, seq_id=3, path="s")
    snapshot = snap.json()["path"]
    other = await _session(client, STRANGER)

    async def stranger_reads() -> list[int]:
        info = await client.post("/api/v1/weights_info", json={"tinker_path": weights}, headers=_h(STRANGER))
        sampler = await client.post(
            "/api/v1/create_sampling_session",
            json={"session_id": other, "sampling_session_seq_id": 0, "model_path": snapshot},
            headers=_h(STRANGER),
        )
        return [info.status_code, sampler.status_code]

    missing = await client.post(
        "/api/v1/weights_info", json={"tinker_path": weights.replace("/w", "/nope")}, headers=_h(STRANGER)
    )
    assert await stranger_reads() == [404, 404]
    assert (await stranger_reads(), missing.status_code) == ([404, 404], 404)  # private reads as missing

    for path in (weights, snapshot):
        assert (await client.post(_rest(path) + "/publish", headers=_h(STRANGER))).status_code == 404
        assert (await client.post(_rest(path) + "/publish", headers=_h(OWNER))).status_code == 204
        # already published is no error (a 409 would keep the SDK retrying for 5 minutes)
        assert (await client.post(_rest(path) + "/publish", headers=_h(OWNER))).status_code == 204
    listed = tt.CheckpointsListResponse.model_validate(
        (await client.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=_h(OWNER))).json()
    )
    assert {c.tinker_path: c.public for c in listed.checkpoints} == {weights: True, snapshot: True}

    assert await stranger_reads() == [200, 200]
    # the stranger loads the published state into a model of its own (create from checkpoint)
    loaded = await _call(client, "load_weights", STRANGER, session_id=other, model_seq_id=0, path=weights)
    assert loaded.status_code == 200 and loaded.json()["path"] == weights
    assert runtime.models[loaded.json()["model_id"]]["bias"] == pytest.approx(0.5)
    # publishing shares reading only: the stranger can neither delete nor unpublish it
    assert (await client.delete(_rest(weights), headers=_h(STRANGER))).status_code == 404
    assert (await client.delete(_rest(weights) + "/publish", headers=_h(STRANGER))).status_code == 404

    for path in (weights, snapshot):
        assert (await client.delete(_rest(path) + "/publish", headers=_h(OWNER))).status_code == 204
        assert (await client.delete(_rest(path) + "/publish", headers=_h(OWNER))).status_code == 204
    info = await client.post("/api/v1/weights_info", json={"tinker_path": weights}, headers=_h(STRANGER))
    assert info.status_code == 404


async def test_a_training_run_is_accessible_to_others_only_with_a_published_checkpoint(env) -> None:
    client, _ = env
    _, model_id = await _model(client)
    weights = (await _call(client, "save_weights", model_id=model_id, seq_id=1, path="w")).json()["path"]
    route = f"/api/v1/training_runs/{model_id}"
    for scope in ("owned", "accessible"):
        r = await client.get(route, params={"access_scope": scope}, headers=_h(STRANGER))
        assert r.status_code == 404
    await client.post(_rest(weights) + "/publish", headers=_h(OWNER))
    owned = await client.get(route, params={"access_scope": "owned"}, headers=_h(STRANGER))
    accessible = await client.get(route, params={"access_scope": "accessible"}, headers=_h(STRANGER))
    assert owned.status_code == 404
    run = tt.TrainingRun.model_validate(accessible.json())
    assert (run.training_run_id, run.model_owner) == (model_id, "owner")


# ---- external weights --------------------------------------------------------------------------------


async def test_save_weights_external_is_downloadable_through_signed_links_only(env) -> None:
    client, _ = env
    _, model_id = await _model(client)
    await _call(client, "optim_step", model_id=model_id, seq_id=1, adam_params={"learning_rate": 0.25})
    saved = await _call(client, "save_weights_external", model_id=model_id, seq_id=2, path="hf")
    result = tt.SaveWeightsExternalResponseInternal.model_validate(saved.json())
    assert result.path == f"tinker://{model_id}/external_weights/hf" and result.size_bytes > 0
    listed = (await client.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=_h(OWNER))).json()
    assert [(c["checkpoint_type"], c["checkpoint_id"]) for c in listed["checkpoints"]] == [
        ("external", "external_weights/hf")
    ]

    route = _rest(result.path) + "/external_weights_urls"
    assert (await client.get(route, headers=_h(STRANGER))).status_code == 404
    urls = tt.ExternalWeightsUrlsResponse.model_validate((await client.get(route, headers=_h(OWNER))).json())
    assert sorted(urls.urls) == ["model.safetensors", "tokenizer/config.json"]  # never metadata.json
    link = urlsplit(urls.urls["model.safetensors"])
    download = await client.get(f"{link.path}?{link.query}")  # no API key: the link is the credential
    assert download.status_code == 200
    assert json.loads(download.content) == {"step": 1, "bias": 0.25}

    tampered = link.query.replace("signature=", "signature=0")
    assert (await client.get(f"{link.path}?{tampered}")).status_code == 404
    other_file = urlsplit(urls.urls["tokenizer/config.json"]).path
    assert (await client.get(f"{other_file}?{link.query}")).status_code == 404  # a signature names one file

    weights = (await _call(client, "save_weights", model_id=model_id, seq_id=3, path="w")).json()["path"]
    not_external = await client.get(_rest(weights) + "/external_weights_urls", headers=_h(OWNER))
    assert not_external.status_code == 400 and "save_weights_external" in not_external.json()["detail"]

    assert (await client.delete(_rest(result.path), headers=_h(OWNER))).status_code == 204
    assert (await client.get(f"{link.path}?{link.query}")).status_code == 404  # gone with its checkpoint


async def test_an_expired_download_link_is_refused(env, tmp_path: Path) -> None:
    client, _ = env
    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    gateway.checkpoint_service = CheckpointService(gateway.checkpoints, url_ttl_s=-1.0)
    _, model_id = await _model(client)
    path = (await _call(client, "save_weights_external", model_id=model_id, seq_id=1, path="x")).json()[
        "path"
    ]
    urls = (await client.get(_rest(path) + "/external_weights_urls", headers=_h(OWNER))).json()["urls"]
    link = urlsplit(urls["model.safetensors"])
    r = await client.get(f"{link.path}?{link.query}")
    assert r.status_code == 404 and "expired" in r.json()["detail"]


async def test_encrypted_exports_are_refused_before_queueing_and_the_order_goes_on(env) -> None:
    client, runtime = env
    _, model_id = await _model(client)
    refused = await client.post(
        "/api/v1/save_weights_external",
        json={"model_id": model_id, "seq_id": 1, "path": "enc", "age_encryption_recipients": ["age1xyz"]},
        headers=_h(OWNER),
    )
    assert refused.status_code == 400 and "age_encryption_recipients" in refused.json()["detail"]
    step = await _call(client, "optim_step", model_id=model_id, seq_id=2, adam_params={"learning_rate": 0.1})
    assert step.status_code == 200 and "metrics" in step.json()
    assert ("save_external", model_id) not in runtime.calls


# ---- listings and get_info -----------------------------------------------------------------------------


async def test_user_checkpoints_are_paged_newest_first_across_runs(env) -> None:
    client, _ = env
    _, first = await _model(client)
    _, second = await _model(client)
    paths = []
    for model_id, seq_id, name in [(first, 1, "a"), (second, 1, "b"), (first, 2, "c")]:
        saved = await _call(client, "save_weights", model_id=model_id, seq_id=seq_id, path=name)
        paths.append(saved.json()["path"])
    await _model(client, STRANGER)
    pages = []
    for offset in (0, 2):
        r = await client.get("/api/v1/checkpoints", params={"limit": 2, "offset": offset}, headers=_h(OWNER))
        page = tt.CheckpointsListResponse.model_validate(r.json())
        assert page.cursor is not None and page.cursor.total_count == 3
        pages.append([c.tinker_path for c in page.checkpoints])
    assert pages == [paths[::-1][:2], paths[::-1][2:]]
    stranger = await client.get("/api/v1/checkpoints", headers=_h(STRANGER))
    assert stranger.json()["checkpoints"] == []


async def test_sessions_are_listed_with_their_runs_and_samplers(env) -> None:
    client, _ = env
    older = await _session(client, OWNER)
    sid, model_id = await _model(client)
    opened = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE}
    await client.post("/api/v1/create_sampling_session", json=opened, headers=_h(OWNER))
    inflight = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 1, "kind": "inflight"}
    await _call(client, "save_weights_for_sampler", **inflight)
    await _session(client, STRANGER)

    listed = tt.ListSessionsResponse.model_validate(
        (await client.get("/api/v1/sessions", headers=_h(OWNER))).json()
    )
    assert listed.sessions == [sid, older]  # newest first, the stranger's not among them
    paged = await client.get("/api/v1/sessions", params={"limit": 1, "offset": 1}, headers=_h(OWNER))
    assert paged.json()["sessions"] == [older]
    got = tt.GetSessionResponse.model_validate(
        (await client.get(f"/api/v1/sessions/{sid}", headers=_h(OWNER))).json()
    )
    assert got.training_run_ids == [model_id]
    assert got.sampler_ids == [f"{sid}:sample:0", f"{sid}:sample:1"]  # no inflight pointer record
    assert (await client.get(f"/api/v1/sessions/{sid}", headers=_h(STRANGER))).status_code == 404


async def test_get_info_reports_the_architecture_its_card_read_from_the_config(env, tmp_path: Path) -> None:
    client, runtime = env
    card = runtime.model_cards()[0]
    runtime.model_cards = lambda: [replace(card, arch="llama")]  # type: ignore[method-assign]
    _, model_id = await _model(client)
    info = await client.post("/api/v1/get_info", json={"model_id": model_id}, headers=_h(OWNER))
    assert tt.GetInfoResponse.model_validate(info.json()).model_data.arch == "llama"


def test_model_arch_is_the_configs_model_type(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert model_arch(tiny_model_dir) == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_arch(tmp_path) == "llama"
    assert model_arch(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("method", "path", "sdk_method"),
    [
        ("PUT", "/api/v1/sessions/s1/project", "assign_session_project"),
        ("POST", "/api/v1/sessions/search", "search_sessions"),
        ("GET", "/api/v1/audit", "get_audit_log"),
        ("GET", "/api/v1/billing/usage/events", "get_billing_usage"),
    ],
)
async def test_sdk_routes_that_cannot_apply_here_are_refused_with_the_reason(
    env, method: str, path: str, sdk_method: str
) -> None:
    client, _ = env
    r = await client.request(method, path, headers=_h(OWNER), json={})
    assert r.status_code == 400  # not retried by the SDK, unlike a 5xx
    assert r.json()["detail"].startswith(f"{sdk_method} is not supported by this self-hosted gateway: ")
    assert (await client.request(method, path, json={})).status_code == 401  # keys first, as everywhere


async def test_a_lora_rank_above_the_cards_cap_is_refused_before_queueing(env) -> None:
    client, runtime = env
    card = runtime.model_cards()[0]
    runtime.model_cards = lambda: [replace(card, max_lora_rank=8)]  # type: ignore[method-assign]
    sid = await _session(client, OWNER)
    body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 16}}
    refused = await client.post("/api/v1/create_model", json=body, headers=_h(OWNER))
    assert refused.status_code == 400 and "LoRA rank 16 is above this job's maximum 8" in refused.text
    assert runtime.calls == []  # nothing reached the runtime
    body["lora_config"] = {"rank": 8}
    assert (await _call(client, "create_model", **body)).status_code == 200
