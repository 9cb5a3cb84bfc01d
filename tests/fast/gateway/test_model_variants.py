"""Model ids with a context variant, `<base>:peft:<context>` (miles/gateway/services/model_ids.py): parsed
on plain data, then through the gateway: capabilities and /v1/models name each base's full-context
variant, a model created as a variant trains only on data that fits its context, sampling a variant
enforces prompt plus max_tokens, a variant longer than the base or malformed is refused, and the runtime
only ever sees the plain base."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from miles.gateway.services.model_ids import ModelId, parse_model_id, variant_id
from tests.fast.gateway.runtime_double import BASE, DoubleRuntime, double_app

KEY = "tml-variants-key-0001"


def test_model_ids_parse_and_print() -> None:
    assert parse_model_id("Qwen/Qwen3-8B") == ModelId("Qwen/Qwen3-8B")
    assert parse_model_id("thinkingmachines/Inkling:peft:262144") == ModelId(
        "thinkingmachines/Inkling", 262144
    )
    assert variant_id("a/b", 4096) == "a/b:peft:4096" and variant_id("a/b", None) == "a/b"
    for bad in ("a:peft:", "a:peft:x", "a:peft:0", ":peft:12", "a:peft:-3"):
        with pytest.raises(ValueError, match="a variant is"):
            parse_model_id(bad)


@pytest.fixture
async def gw(tmp_path: Path, tiny_model_dir: Path):
    runtime = DoubleRuntime(tokenizer_path=str(tiny_model_dir))
    app = double_app(tmp_path, runtime, {KEY: "alpha"}, long_poll_s=0.3)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        yield client, runtime
    await app.state.gateway.ops.close()


def _h() -> dict[str, str]:
    return {"X-API-Key": KEY}


async def _result(client: httpx.AsyncClient, request_id: str) -> httpx.Response:
    for _ in range(100):
        r = await client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=_h())
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r
    raise AssertionError("future never resolved")


def _fwdbwd(model_id: str, tokens: int, seq_id: int = 1) -> bytes:
    """A forward_backward body as the SDK sends it (protobuf) of one datum of `tokens` input tokens."""
    ids = list(range(1, tokens + 1))
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ids),
        loss_fn_inputs={"target_tokens": tinker.TensorData(data=ids, dtype="int64", shape=[tokens])},
    )
    req = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


async def test_variants_are_advertised_resolved_and_enforced(gw) -> None:
    client, runtime = gw
    created: list[str] = []
    create = runtime.create_model

    async def recording_create(model_id, base_model, lora):
        created.append(base_model)
        await create(model_id, base_model, lora)

    runtime.create_model = recording_create
    caps = (await client.get("/api/v1/get_server_capabilities", headers=_h())).json()["supported_models"]
    full = caps[0]["max_context_length"]
    assert [m["model_name"] for m in caps] == [BASE, f"{BASE}:peft:{full}"]
    models = (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).json()["data"]
    assert f"{BASE}:peft:{full}" in {m["id"] for m in models}

    sid = (await client.post("/api/v1/create_session", json={"tags": []}, headers=_h())).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": f"{BASE}:peft:16", "lora_config": {"rank": 4}}
    r = await client.post("/api/v1/create_model", json=body, headers=_h())
    assert (await _result(client, r.json()["request_id"])).status_code == 200
    model_id = f"{sid}:train:0"
    assert created == [BASE], "the runtime sees the plain base"

    r = await client.post("/api/v1/forward_backward", content=_fwdbwd(model_id, 17), headers=_h())
    refused = await _result(client, r.json()["request_id"])
    assert refused.json()["category"] == "user" and "at most 16" in refused.json()["error"], refused.text
    r = await client.post("/api/v1/forward_backward", content=_fwdbwd(model_id, 16, seq_id=2), headers=_h())
    assert r.status_code == 200 and (await _result(client, r.json()["request_id"])).status_code == 200

    for bad, said in (
        (f"{BASE}:peft:{full + 1}", f"at most {full} tokens"),
        (f"{BASE}:peft:zero", "a variant is"),
    ):
        refused = {"session_id": sid, "model_seq_id": 5, "base_model": bad, "lora_config": {"rank": 4}}
        r = await client.post("/api/v1/create_model", json=refused, headers=_h())
        assert r.status_code == 400 and said in r.json()["detail"], r.text

    bearer = {"Authorization": f"Bearer {KEY}"}
    ok = {"model": f"{BASE}:peft:8", "prompt": [1, 2, 3], "max_tokens": 5}
    assert (await client.post("/v1/completions", json=ok, headers=bearer)).status_code == 200
    r = await client.post("/v1/completions", json={**ok, "max_tokens": 6}, headers=bearer)
    assert r.status_code == 400 and f"exceed the context of {BASE}:peft:8" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={**ok, "model": "nope:peft:8"}, headers=bearer)
    assert r.status_code == 404
