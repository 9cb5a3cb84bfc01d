"""The gateway app in-process (httpx ASGI transport) over a runtime test double."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime, double_app
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from miles.checkpoints.manager import CheckpointManager
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.settings import GatewaySettings
from miles.state import MemoryStateStore

KEY_A, KEY_B = "tml-alpha-key-0001", "tml-bravo-key-0002"


def _app(tmp_path: Path, runtime: DoubleRuntime, **settings: float):
    keys = {KEY_A: "alpha", KEY_B: "bravo"}
    return double_app(tmp_path, runtime, keys, long_poll_s=0.3, openai_sample_timeout_s=0.5, **settings)


@pytest.fixture
async def env(tmp_path: Path, tiny_model_dir: Path):
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    app = _app(tmp_path, runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as client:
        yield client, runtime, tmp_path / "ckpt"
    await app.state.gateway.ops.close()


def _h(key: str = KEY_A, **extra: str) -> dict[str, str]:
    return {"X-API-Key": key, **extra}


async def _result(client: httpx.AsyncClient, request_id: str, key: str = KEY_A) -> httpx.Response:
    for _ in range(100):
        r = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=_h(key))
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError("future never resolved")


async def _create_model(client: httpx.AsyncClient, sid: str, seq: int = 0, key: str = KEY_A) -> str:
    r = await client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": seq, "base_model": BASE, "lora_config": {"rank": 4}},
        headers=_h(key),
    )
    assert r.status_code == 200, r.text
    model_id = (await _result(client, r.json()["request_id"], key)).json()["model_id"]
    assert model_id == f"{sid}:train:{seq}"
    return model_id


async def _session_and_model(client: httpx.AsyncClient, key: str = KEY_A) -> tuple[str, str]:
    sid = (await client.post("/api/v1/create_session", json={"tags": []}, headers=_h(key))).json()[
        "session_id"
    ]
    return sid, await _create_model(client, sid, 0, key)


async def _released(runtime: DoubleRuntime, model_ids: set[str]) -> list[str]:
    """The models the runtime released, once all of `model_ids` are among them (5 s at most)."""
    for _ in range(500):
        released = [m for call, m in runtime.calls if call == "release_model"]
        if model_ids <= set(released):
            return released
        await asyncio.sleep(0.01)
    raise AssertionError(f"the runtime never released {model_ids - set(released)}")


def _fwdbwd_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy", forward_only=False) -> bytes:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": tinker.TensorData(data=[2, 3, 4], dtype="int64", shape=[3])},
    )
    req = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


async def test_health_metrics_and_auth_errors_have_json_bodies(env) -> None:
    client, runtime, _ = env
    assert (await client.get("/api/v1/healthz")).json() == {"status": "ok"}
    # a live runtime that serves in part says what happened, and stays 200 (the watchdog counts 503s)
    why = "engine cell 1: release_memory_occupation failed: 400"
    runtime.degradation = lambda: why
    r = await client.get("/api/v1/healthz")
    assert r.status_code == 200 and r.json() == {"status": "degraded", "runtime": why}
    runtime.degradation = lambda: None
    assert (await client.get("/api/v1/healthz")).json() == {"status": "ok"}
    runtime.problem = "no trainer cell is alive"
    r = await client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable", "error": "no trainer cell is alive"}
    r = await client.post("/api/v1/create_session", json={})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    r = await client.post("/api/v1/create_session", json={}, headers=_h("tml-wrong-key-123"))
    assert r.status_code == 401
    for method, path in (("GET", "/api/v1/nope"), ("GET", "/api/v1/create_session")):
        r = await client.request(method, path, headers=_h())
        assert r.status_code in (404, 405) and r.json()["detail"]
    r = await client.post("/api/v1/optim_step", json={"model_id": 3}, headers=_h())
    assert r.status_code == 400 and "invalid request" in r.json()["detail"]
    metrics = await client.get("/metrics")
    assert "miles_gateway_requests_total" in metrics.text


async def test_sessions_heartbeat_finish_and_410(env) -> None:
    client, _, _ = env
    sid = (await client.post("/api/v1/create_session", json={"tags": ["x"]}, headers=_h())).json()[
        "session_id"
    ]
    beat = {"session_id": sid, "type": "session_heartbeat"}
    assert (await client.post("/api/v1/session_heartbeat", json=beat, headers=_h())).status_code == 200
    r = await client.post(
        f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}, headers=_h()
    )
    assert r.status_code == 200
    r = await client.post("/api/v1/session_heartbeat", json=beat, headers=_h())
    assert r.status_code == 410 and r.json()["detail"]


async def test_finishing_a_session_releases_its_models_in_the_runtime(env) -> None:
    client, runtime, _ = env
    sid, first = await _session_and_model(client)
    second = await _create_model(client, sid, 1)
    _, other = await _session_and_model(client)
    assert set(runtime.models) == {first, second, other}
    r = await client.post(f"/api/v1/sessions/{sid}/finish", json={"reason": None}, headers=_h())
    assert r.status_code == 200
    released = await _released(runtime, {first, second})
    assert other not in released and set(runtime.models) == {other}
    # the model's record stays (training runs, checkpoints); its operations no longer run
    assert (await client.get(f"/api/v1/training_runs/{first}", headers=_h())).status_code == 200
    r = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(first, 1), headers=_h())
    assert (await _result(client, r.json()["request_id"])).json()["error"]
    r = await client.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=_h())
    assert r.status_code == 200 and await _released(runtime, set()) == released, "released once"


async def test_a_silent_session_is_expired_by_the_sweep_and_its_models_released(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    app = _app(tmp_path, runtime, session_timeout_s=0.3, session_sweep_s=0.05)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as client,
    ):
        sid, model_id = await _session_and_model(client)
        beat = {"session_id": sid, "type": "session_heartbeat"}
        assert (await client.post("/api/v1/session_heartbeat", json=beat, headers=_h())).status_code == 200
        assert await _released(runtime, {model_id}) == [model_id]
        r = await client.post("/api/v1/session_heartbeat", json=beat, headers=_h())
        assert r.status_code == 410 and "expired" in r.json()["detail"]


async def test_unknown_base_model_is_a_400_and_unknown_future_a_404(env) -> None:
    client, _, _ = env
    sid = (await client.post("/api/v1/create_session", json={}, headers=_h())).json()["session_id"]
    r = await client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": 0, "base_model": "org/none"},
        headers=_h(),
    )
    assert r.status_code == 400 and BASE in r.json()["detail"]
    r = await client.post("/api/v1/retrieve_future", json={"request_id": "req-missing"}, headers=_h())
    assert r.status_code == 404 and r.json()["detail"]


async def test_pipelined_ops_run_in_seq_order_and_results_decode_in_the_sdk(env) -> None:
    client, runtime, _ = env
    _, model_id = await _session_and_model(client)
    optim = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 0.5}, "type": "optim_step"}
    r_opt = await client.post("/api/v1/optim_step", json=optim, headers=_h())
    r_fb2 = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 2), headers=_h())
    r_fb1 = await client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1, forward_only=True), headers=_h()
    )
    out1 = deserialize_forward_backward_output((await _result(client, r_fb1.json()["request_id"])).content)
    assert out1.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.02, -0.03, -0.04])
    assert (await _result(client, r_opt.json()["request_id"])).json()["metrics"] == {"step:max": 1.0}
    assert [c for c, _ in runtime.calls] == ["create_model", "forward", "forward_backward", "optim_step"]
    # A retried submit (same seq_id) answers with the original future and does not run again.
    again = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 2), headers=_h())
    assert again.json()["request_id"] == r_fb2.json()["request_id"]
    assert len(runtime.calls) == 4
    bad = await client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 4, "dpo"), headers=_h()
    )
    failure = (await _result(client, bad.json()["request_id"])).json()
    assert failure["category"] == "user" and "dpo" in failure["error"]


async def test_a_refused_request_does_not_leave_a_gap_in_the_seq_id_order(env) -> None:
    """The SDK never resends a request refused with a 4xx; the next seq_id must not wait for it (the
    gap timeout here is the default 120 s, so a gap left open fails this test by timing out)."""
    client, runtime, _ = env
    _, model_id = await _session_and_model(client)
    _, other_model = await _session_and_model(client, KEY_B)
    unknown = await client.post(
        "/api/v1/save_weights_somewhere", json={"model_id": model_id, "seq_id": 1}, headers=_h()
    )
    assert unknown.status_code == 404 and unknown.json()["detail"]
    dimuon = {"model_id": model_id, "seq_id": 2, "adam_params": {}, "optimizer_params": {"type": "dimuon"}}
    refused = await client.post("/api/v1/optim_step", json=dimuon, headers=_h())
    assert refused.status_code == 400 and "only Adam" in refused.json()["detail"]
    proto = await client.post(
        "/api/v1/forward_backward_v2",
        content=_fwdbwd_body(model_id, 3),
        headers=_h(**{"Content-Type": "application/x-protobuf"}),
    )
    assert proto.status_code == 404
    # another tenant's refusal naming this model skips nothing: seq_id 5 waits for a real 4
    foreign = await client.post(
        "/api/v1/save_weights_somewhere", json={"model_id": model_id, "seq_id": 4}, headers=_h(KEY_B)
    )
    assert foreign.status_code == 404
    optim = {"model_id": model_id, "seq_id": 5, "adam_params": {"learning_rate": 0.1}, "type": "optim_step"}
    r_opt = await client.post("/api/v1/optim_step", json=optim, headers=_h())
    await asyncio.sleep(0.2)
    assert ("optim_step", model_id) not in runtime.calls
    r_fb = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 4), headers=_h())
    assert (await _result(client, r_fb.json()["request_id"])).status_code == 200
    assert (await _result(client, r_opt.json()["request_id"])).json()["metrics"] == {"step:max": 1.0}
    assert [c for c, m in runtime.calls if m == model_id] == [
        "create_model",
        "forward_backward",
        "optim_step",
    ]
    assert other_model != model_id


async def test_client_config_advertises_zstd_and_a_zstd_forward_backward_runs(env) -> None:
    import zstandard

    client, runtime, _ = env
    config = (await client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers=_h())).json()
    assert config["proto_compress_fwdbwd"] is True and config["pjwt_auth_enabled"] is False
    _, model_id = await _session_and_model(client)
    packed = zstandard.ZstdCompressor().compress(_fwdbwd_body(model_id, 1))
    headers = _h(**{"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    r = await client.post("/api/v1/forward_backward", content=packed, headers=headers)
    out = deserialize_forward_backward_output((await _result(client, r.json()["request_id"])).content)
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx([-0.02, -0.03, -0.04])
    assert ("forward_backward", model_id) in runtime.calls
    garbled = await client.post("/api/v1/forward_backward", content=b"\x28\xb5\x2f\xfd junk", headers=headers)
    assert garbled.status_code == 400 and "zstd" in garbled.json()["detail"]


class FullModeRuntime(DoubleRuntime):
    """The double as a job whose preset says model.train_mode: full; it records what create_model got."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.created_with: list[object] = []

    def model_cards(self):
        return [dataclasses.replace(card, train_mode="full") for card in super().model_cards()]

    async def create_model(self, model_id, base_model, lora) -> None:
        self.created_with.append(lora)
        await super().create_model(model_id, base_model, lora)


def _create_body(sid: str, seq: int, rank: int) -> dict:
    return {"session_id": sid, "model_seq_id": seq, "base_model": BASE, "lora_config": {"rank": rank}}


async def test_rank_zero_asks_for_full_fine_tuning_where_the_preset_allows_it(env, tmp_path, tiny_model_dir):
    client, _runtime, _ = env
    sid = (await client.post("/api/v1/create_session", json={"tags": []}, headers=_h())).json()["session_id"]
    refused = await client.post("/api/v1/create_model", json=_create_body(sid, 0, 0), headers=_h())
    assert (
        refused.status_code == 400
        and "rank=0 (full fine-tuning) needs a job whose train_mode is full" in (refused.json()["detail"])
    )
    full_runtime = FullModeRuntime(tokenizer_path=str(tiny_model_dir))
    app = _app(tmp_path / "full", full_runtime)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as full:
        sid = (await full.post("/api/v1/create_session", json={"tags": []}, headers=_h())).json()[
            "session_id"
        ]
        lora_on_full = await full.post("/api/v1/create_model", json=_create_body(sid, 0, 4), headers=_h())
        assert (
            lora_on_full.status_code == 400
            and "create the training client with rank=0" in (lora_on_full.json()["detail"])
        )
        r = await full.post("/api/v1/create_model", json=_create_body(sid, 1, 0), headers=_h())
        assert r.status_code == 200, r.text
        model_id = (await _result(full, r.json()["request_id"])).json()["model_id"]
        assert full_runtime.created_with == [None]  # the runtime was asked for the full model
        info = (await full.post("/api/v1/get_info", json={"model_id": model_id}, headers=_h())).json()
        assert info["is_lora"] is False and info["lora_rank"] is None
    await app.state.gateway.ops.close()


def _provenance_body(model_id: str, seq_id: int, prompt: list[int], sampled: list[int], sequence_id: str):
    """A stable_reinforce datum over prompt + sampled tokens, its provenance attached as the SDK does."""
    tokens = prompt + sampled
    n = len(tokens) - 1
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "logprobs": np.full(n, -3.0, np.float32),  # the client's copy: replaced at sampled positions
            "advantages": np.ones(n, np.float32),
        },
    ).with_provenance(
        model_input=[
            tinker.PromptProvenanceSpan(sequence_id=sequence_id, length=len(prompt)),
            tinker.SampledProvenanceSpan(sequence_id=sequence_id, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            tinker.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(prompt) - 1),
            tinker.SampledProvenanceSpan(sequence_id=sequence_id, length=len(sampled)),
        ],
    )
    req = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


async def test_stable_reinforce_uses_the_recorded_sampler_logprobs_its_provenance_names(env) -> None:
    client, runtime, _ = env
    sid, model_id = await _session_and_model(client)
    seen: list[list] = []
    original = runtime.forward_backward

    async def recording(request):
        seen.append(request.data)
        return await original(request)

    runtime.forward_backward = recording
    r = await client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE},
        headers=_h(),
    )
    sample = {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [5, 6, 7], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 3},
        "sampling_session_id": r.json()["sampling_session_id"],
        "seq_id": 0,
        "record_stability_info": True,
    }
    r = await client.post("/api/v1/asample", json=sample, headers=_h())
    second = r.json()["sample_sequence_ids"][1]
    resp = deserialize_sample_response((await _result(client, r.json()["request_id"])).content)
    sampled = list(resp.sequences[1].tokens)
    body = _provenance_body(model_id, 1, [5, 6, 7], sampled, second)
    r = await client.post("/api/v1/forward_backward", content=body, headers=_h())
    assert (await _result(client, r.json()["request_id"])).status_code == 200
    (datum,) = seen[-1]
    # prompt targets keep the client's -3.0; the sampled ones carry the engine's -0.5 (the double's)
    assert datum.loss_fn_inputs["logprobs"].tolist() == [-3.0, -3.0, -0.5, -0.5, -0.5]

    wrong = _provenance_body(model_id, 2, [5, 6, 7], [t + 1 for t in sampled], second)
    r = await client.post("/api/v1/forward_backward", content=wrong, headers=_h())
    failure = (await _result(client, r.json()["request_id"])).json()
    assert failure["category"] == "user" and "are not the tokens sampled" in failure["error"]
    _, other_model = await _session_and_model(client, KEY_B)  # another tenant cannot name our samples
    foreign = _provenance_body(other_model, 1, [5, 6, 7], sampled, second)
    r = await client.post("/api/v1/forward_backward", content=foreign, headers=_h(KEY_B))
    failure = (await _result(client, r.json()["request_id"], KEY_B)).json()
    assert failure["category"] == "user" and "was not sampled by this key" in failure["error"]


async def test_try_again_after_long_poll(env) -> None:
    client, _runtime, _ = env
    _, model_id = await _session_and_model(client)
    r = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 2), headers=_h())
    poll = await client.post(
        "/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=_h()
    )
    assert poll.json()["type"] == "try_again" and poll.json()["queue_state"] == "active"


async def test_a_checkpoint_ttl_set_over_rest_is_swept_and_a_restart_lists_checkpoints_on_disk(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    now = [1000.0]
    store = MemoryStateStore()
    checkpoints = CheckpointManager(tmp_path / "ckpt", store, clock=lambda: now[0])
    keys = ApiKeys({KEY_A: "alpha", KEY_B: "bravo"})
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    app = create_app(
        runtime, store, checkpoints, keys, GatewaySettings(long_poll_s=0.3, session_sweep_s=0.05)
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as client,
    ):
        sid, model_id = await _session_and_model(client)
        for seq, name in ((1, "short"), (2, "keep")):
            save = {"model_id": model_id, "path": name, "seq_id": seq}
            r = await client.post("/api/v1/save_weights", json=save, headers=_h())
            assert (await _result(client, r.json()["request_id"])).status_code == 200
        # a sampler snapshot that an open sampling session of this (active) session samples from
        snap = {"model_id": model_id, "path": "snap", "sampling_session_seq_id": 0, "seq_id": 3}
        r = await client.post("/api/v1/save_weights_for_sampler", json=snap, headers=_h())
        assert (await _result(client, r.json()["request_id"])).status_code == 200
        runs = f"/api/v1/training_runs/{model_id}/checkpoints"
        ttl = f"{runs}/weights/short/ttl"
        assert (await client.put(ttl, json={"ttl_seconds": 3600}, headers=_h(KEY_B))).status_code == 404
        assert (await client.put(ttl, json={"ttl_seconds": -1}, headers=_h())).status_code == 400
        assert (await client.put(ttl, json={"ttl_seconds": 3600}, headers=_h())).status_code == 204
        r = await client.put(f"{runs}/sampler_weights/snap/ttl", json={"ttl_seconds": 3600}, headers=_h())
        assert r.status_code == 204
        now[0] += 3601

        async def listed_once(want: set[str]) -> set[str]:
            for _ in range(100):  # the sweep runs every 50 ms
                listed = (await client.get("/api/v1/checkpoints", headers=_h())).json()["checkpoints"]
                if {c["checkpoint_id"] for c in listed} == want:
                    break
                await asyncio.sleep(0.05)
            return {c["checkpoint_id"] for c in listed}

        served = {"weights/keep", "sampler_weights/snap"}
        assert await listed_once(served) == served, (
            "an expired snapshot that an open sampler serves stays while its session is active"
        )
        assert not (tmp_path / "ckpt" / model_id / "weights" / "short").exists()
        assert (await client.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=_h())).status_code == 200
        assert await listed_once({"weights/keep"}) == {"weights/keep"}
    await app.state.gateway.ops.close()

    # A gateway restarted over a fresh memory store lists what is on disk (and only its owner's).
    fresh_store = MemoryStateStore()
    restarted = create_app(runtime, fresh_store, CheckpointManager(tmp_path / "ckpt", fresh_store), keys)
    async with (
        restarted.router.lifespan_context(restarted),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=restarted), base_url="http://gw") as client,
    ):
        listed = (await client.get("/api/v1/checkpoints", headers=_h())).json()["checkpoints"]
        assert [c["tinker_path"] for c in listed] == [f"tinker://{model_id}/weights/keep"]
        assert (await client.get("/api/v1/checkpoints", headers=_h(KEY_B))).json()["checkpoints"] == []
    await restarted.state.gateway.ops.close()


async def test_checkpoints_samplers_and_tenant_isolation_matrix(env) -> None:
    client, runtime, root = env
    sid, model_id = await _session_and_model(client)
    save = {"model_id": model_id, "path": "ckpt-1", "seq_id": 1, "type": "save_weights"}
    r = await client.post("/api/v1/save_weights", json=save, headers=_h())
    weights_path = (await _result(client, r.json()["request_id"])).json()["path"]
    assert weights_path == f"tinker://{model_id}/weights/ckpt-1"
    unnamed = {"model_id": model_id, "sampling_session_seq_id": 0, "seq_id": 2}
    r = await client.post("/api/v1/save_weights_for_sampler", json=unnamed, headers=_h())
    res = (await _result(client, r.json()["request_id"])).json()
    sampler_id = res["sampling_session_id"]
    assert sampler_id == f"{sid}:sample:0" and "/sampler_weights/" in res["path"]
    sample = {
        "num_samples": 3,
        "prompt": {
            "chunks": [{"tokens": [1, 2], "type": "encoded_text"}, {"tokens": [3], "type": "encoded_text"}]
        },
        "sampling_params": {"max_tokens": 2},
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "prompt_logprobs": True,
    }
    r = await client.post("/api/v1/asample", json=sample, headers=_h())
    assert len(r.json()["sample_sequence_ids"]) == 3
    resp = deserialize_sample_response((await _result(client, r.json()["request_id"])).content)
    assert [len(s.tokens) for s in resp.sequences] == [2, 2, 2]
    assert resp.prompt_logprobs == [None, -1.0, -1.0]
    assert runtime.calls[-1] == ("sample", res["path"])
    future_id = r.json()["request_id"]

    # Everything alpha owns is invisible to bravo: 404, never 403, and nothing is touched.
    checks = [
        ("POST", "/api/v1/session_heartbeat", {"session_id": sid}),
        ("POST", "/api/v1/get_info", {"model_id": model_id}),
        ("POST", "/api/v1/retrieve_future", {"request_id": future_id}),
        ("GET", f"/api/v1/samplers/{sampler_id}", None),
        ("GET", f"/api/v1/training_runs/{model_id}", None),
        ("POST", "/api/v1/weights_info", {"tinker_path": weights_path}),
        ("DELETE", f"/api/v1/training_runs/{model_id}/checkpoints/weights/ckpt-1", None),
        ("POST", "/api/v1/asample", {**sample, "seq_id": 1}),
        ("POST", "/api/v1/asample", {**sample, "sampling_session_id": None, "model_path": res["path"]}),
        ("POST", "/api/v1/optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {}}),
    ]
    for method, path, body in checks:
        r = await client.request(method, path, json=body, headers=_h(KEY_B))
        assert r.status_code == 404, (path, r.status_code, r.text)
        assert r.json()["detail"]
    assert (await client.get("/api/v1/checkpoints", headers=_h(KEY_B))).json()["checkpoints"] == []
    assert (await client.get("/api/v1/training_runs", headers=_h(KEY_B))).json()["training_runs"] == []
    assert (root / model_id / "weights" / "ckpt-1").is_dir()

    run = (await client.get(f"/api/v1/training_runs/{model_id}", headers=_h())).json()
    assert run["last_checkpoint"]["tinker_path"] == weights_path and run["is_lora"] and run["lora_rank"] == 4
    r = await client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/ckpt-1", headers=_h())
    assert r.status_code == 204 and not (root / model_id / "weights" / "ckpt-1").exists()
    r = await client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights", headers=_h())
    assert r.status_code == 404


async def test_openai_routes_errors_and_budget(env) -> None:
    client, runtime, _ = env
    bearer = {"Authorization": f"Bearer {KEY_A}"}
    chat = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = await client.post("/v1/chat/completions", json=chat, headers=bearer)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    r = await client.post(
        "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer tml-nope-nope"}
    )
    assert r.status_code == 401 and r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={**chat, "model": "gpt-x"}, headers=bearer)
    assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
    runtime.sample_empty = True
    assert (
        await client.post("/v1/completions", json={"model": BASE, "prompt": "a"}, headers=bearer)
    ).status_code == 502
    runtime.sample_empty, runtime.sample_delay_s = False, 5.0
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "a"}, headers=bearer)
    assert r.status_code == 504 and r.json()["error"]["message"]
    await asyncio.sleep(0)


class _GoneClient:
    """A request whose client has disconnected."""

    def __init__(self, app) -> None:
        self.app = app

    async def is_disconnected(self) -> bool:
        return True


async def test_openai_sampling_stops_when_the_client_disconnects(env) -> None:
    from miles.gateway.openai.routes import CompletionBody, _sample
    from miles.seam.runtime import SamplerTarget

    client, runtime, _ = env
    runtime.sample_delay_s = 30.0
    gw = client._transport.app.state.gateway
    body = CompletionBody(model=BASE, prompt="hello")
    out = await _sample(gw, _GoneClient(None), SamplerTarget(BASE), [1, 2, 3], body)
    assert out is None and runtime.samples_cancelled == 1


async def test_the_hosted_openai_path_and_base_semicolon_path_models(env) -> None:
    """/oai/api/v1 (the hosted service's OpenAI base URL) serves what /v1 does, in OpenAI's error shape;
    `model` may be `<base>;<sampler path>` when the base is the checkpoint's own."""
    client, runtime, _ = env
    bearer = {"Authorization": f"Bearer {KEY_A}"}
    _sid, model_id = await _session_and_model(client)
    snap = {"model_id": model_id, "path": "snap", "seq_id": 1}
    r = await client.post("/api/v1/save_weights_for_sampler", json=snap, headers=_h())
    path = (await _result(client, r.json()["request_id"])).json()["path"]
    models = (await client.get("/oai/api/v1/models", headers=bearer)).json()["data"]
    assert {m["id"] for m in models} >= {BASE, path}
    for model in (BASE, path, f"{BASE};{path}"):
        body = {"model": model, "prompt": "a b", "max_tokens": 2}
        r = await client.post("/oai/api/v1/completions", json=body, headers=bearer)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (model, r.text)
    assert runtime.calls[-1] == ("sample", path)
    chat = {"model": f"{BASE};{path}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/oai/api/v1/chat/completions", json=chat, headers=bearer)).status_code == 200
    for model, status, said in (
        (f"other-base;{path}", 404, "does not exist"),
        (f"{BASE};not-a-path", 400, "after ';' comes a tinker:// sampler path"),
        (f"{BASE};tinker://{model_id}/sampler_weights/none", 404, ""),
    ):
        r = await client.post("/oai/api/v1/completions", json={"model": model, "prompt": "a"}, headers=bearer)
        assert r.status_code == status and said in r.json()["error"]["message"], (model, r.text)
    r = await client.post("/oai/api/v1/completions", json={"model": BASE, "prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_api_key"


async def test_ignore_eos_runs_to_max_tokens_and_refuses_stop_strings(env) -> None:
    client, runtime, _ = env
    bearer = {"Authorization": f"Bearer {KEY_A}"}
    seen = []
    sample = runtime.sample

    async def recording(target, prompt, params, num_samples, logprobs):
        seen.append(params)
        return await sample(target, prompt, params, num_samples, logprobs)

    runtime.sample = recording
    body = {"model": BASE, "prompt": "a b", "max_tokens": 3, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body, headers=bearer)).status_code == 200
    assert (seen[0].stop_strings, seen[0].stop_token_ids) == ((), ()), "never stop early"
    r = await client.post("/v1/completions", json={**body, "stop": ["x"]}, headers=bearer)
    assert r.status_code == 400 and "ignore_eos" in r.json()["error"]["message"]
