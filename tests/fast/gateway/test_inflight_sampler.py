"""save_weights_and_get_sampling_client(kind="inflight"): one sampling target per training model that
follows its inflight saves, next to snapshot samplers that never move (the runtime double records which
snapshot each sample ran on)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from runtime_double import BASE, DoubleRuntime, asgi_client, double_app
from tinker.types import SampleRequest

KEY = "tml-inflight-key-0001"
HEADERS = {"X-API-Key": KEY}


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, DoubleRuntime]]:
    runtime = DoubleRuntime()
    async with asgi_client(double_app(tmp_path, runtime, {KEY: "alpha"})) as client:
        yield client, runtime


async def _done(client: httpx.AsyncClient, r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    for _ in range(200):
        out = await client.post(
            "/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=HEADERS
        )
        if (
            out.headers["content-type"].startswith("application/json")
            and out.json().get("type") == "try_again"
        ):
            continue
        return out
    raise AssertionError("future never resolved")


class Model:
    def __init__(self, client: httpx.AsyncClient, session_id: str, model_id: str) -> None:
        self.client, self.session_id, self.model_id = client, session_id, model_id
        self.seq_id = 0
        self.sampler_seq = 0

    async def post(self, route: str, **body: Any) -> Any:
        self.seq_id += 1
        r = await self.client.post(
            f"/api/v1/{route}",
            json={"model_id": self.model_id, "seq_id": self.seq_id, **body},
            headers=HEADERS,
        )
        return await _done(self.client, r)

    async def sampler(self, kind: str) -> str:
        """What save_weights_and_get_sampling_client sends; the opened sampling session's id."""
        self.sampler_seq += 1
        out = await self.post("save_weights_for_sampler", sampling_session_seq_id=self.sampler_seq, kind=kind)
        return out.json()["sampling_session_id"]


async def _model(client: httpx.AsyncClient) -> Model:
    session = (await client.post("/api/v1/create_session", json={"tags": []}, headers=HEADERS)).json()
    body = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4},
    }
    r = await client.post("/api/v1/create_model", json=body, headers=HEADERS)
    await _done(client, r)
    return Model(client, session["session_id"], r.json()["model_id"])


async def _sampled_on(client: httpx.AsyncClient, runtime: DoubleRuntime, sampler_id: str) -> str:
    """The snapshot the runtime sampled from for one sample on `sampler_id`."""
    body = SampleRequest(
        prompt=tinker.ModelInput.from_ints([5, 6]),
        sampling_params=tinker.SamplingParams(max_tokens=1),
        sampling_session_id=sampler_id,
        seq_id=len(runtime.calls),
    ).model_dump(mode="json", exclude_none=True)
    await _done(client, await client.post("/api/v1/asample", json=body, headers=HEADERS))
    kind, target = runtime.calls[-1]
    assert kind == "sample"
    return target


async def test_an_inflight_sampler_follows_later_inflight_saves(gateway) -> None:
    client, runtime = gateway
    model = await _model(client)
    first = await model.sampler("inflight")
    on_first = await _sampled_on(client, runtime, first)
    snapshot = await model.sampler("snapshot")
    assert await _sampled_on(client, runtime, snapshot) != on_first  # a save of its own
    second = await model.sampler("inflight")
    on_second = await _sampled_on(client, runtime, second)
    assert on_second not in (on_first, await _sampled_on(client, runtime, snapshot))
    # the earlier inflight client now samples the newer weights; the snapshot client stays put
    assert await _sampled_on(client, runtime, first) == on_second
    assert await _sampled_on(client, runtime, snapshot) != on_second


async def test_inflight_targets_are_per_model(gateway) -> None:
    client, runtime = gateway
    a, b = await _model(client), await _model(client)
    on_a = await _sampled_on(client, runtime, await a.sampler("inflight"))
    on_b = await _sampled_on(client, runtime, await b.sampler("inflight"))
    assert a.model_id in on_a and b.model_id in on_b


async def test_an_unknown_sampler_kind_is_refused(gateway) -> None:
    client, _runtime = gateway
    model = await _model(client)
    model.seq_id += 1
    r = await client.post(
        "/api/v1/save_weights_for_sampler",
        json={
            "model_id": model.model_id,
            "seq_id": model.seq_id,
            "sampling_session_seq_id": 1,
            "kind": "live",
        },
        headers=HEADERS,
    )
    body = r.json() if r.headers["content-type"].startswith("application/json") else {}
    if r.status_code == 200 and "request_id" in body:
        body = (await _done(client, r)).json()
    assert "kind must be 'snapshot' or 'inflight'" in str(body)


async def test_unnamed_lora_saves_are_written_snapshots_not_ephemeral(gateway, tmp_path: Path) -> None:
    """The engines load a LoRA snapshot from its files, so an unnamed save still writes one (only a full
    fine-tuning job's unnamed saves are ephemeral: tests/fast/runtime/test_ephemeral_sampler_sdk.py)."""
    client, runtime = gateway
    model = await _model(client)
    for kind in ("snapshot", "inflight"):
        target = await _sampled_on(client, runtime, await model.sampler(kind))
        assert target.startswith(f"tinker://{model.model_id}/sampler_weights/") and "ephemeral" not in target
    saves = [call for call in runtime.calls if call[0] == "save_for_sampler"]
    assert saves == [("save_for_sampler", model.model_id)] * 2
    assert len(list((tmp_path / "ckpt").rglob("adapter.json"))) == 2
