"""Stage timings of a forward_backward (X-Miles-Stages), and the request counter that replaced Starlette's
BaseHTTPMiddleware."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from runtime_double import DoubleRuntime, asgi_client, double_app
from test_app import KEY_A, _fwdbwd_body, _h, _result, _session_and_model

from miles.gateway.stages import STAGES_HEADER, StageClock, StageClocks, parse_stages
from miles.seam.requests import ForwardBackwardRequest
from miles.types import ForwardBackwardOutput

COMPUTE_NS = 4_000_000  # what the timed double reports its backend computed (it sleeps 10 ms in all)
FORWARD_BACKWARD_STAGES = [
    "http_in",
    "decode",
    "admit",
    "queue_wait",
    "mark_running",
    "prepare",
    "dispatch",
    "compute",
    "encode",
    "publish",
    "notify",
]


class TimedDouble(DoubleRuntime):
    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        out = await super().forward_backward(request)
        out.compute_ns = COMPUTE_NS
        return out


def test_a_clock_marks_stages_in_order_splits_an_inner_duration_and_round_trips_its_header() -> None:
    clock = StageClock()
    time.sleep(0.002)
    clock.mark("a")
    clock.mark("b")
    time.sleep(0.002)
    clock.mark("a")  # a stage named again adds up
    clock.split("a", "inner", 1_000_000)
    clock.split("b", "never_more_than_the_stage", 10**12)
    assert list(clock.stages) == ["a", "b", "inner", "never_more_than_the_stage"]
    assert clock.stages["a"] >= 3_000_000 and clock.stages["inner"] == 1_000_000
    assert clock.stages["b"] == 0
    parsed = parse_stages(clock.header())
    assert list(parsed) == list(clock.stages)
    assert parsed["inner"] == 1.0 and parsed["a"] == pytest.approx(clock.stages["a"] / 1e6, abs=1e-3)


def test_only_the_newest_clocks_are_kept() -> None:
    clocks = StageClocks(limit=2)
    for rid in ("r1", "r2", "r3"):
        clocks.keep(rid, StageClock())
    assert clocks.get("r1") is None and clocks.get("r2") is not None and clocks.get("r3") is not None


async def test_a_forward_backward_answers_every_stage_once_and_they_fit_in_its_wall_time(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    app = double_app(tmp_path, TimedDouble(tokenizer_path=str(tiny_model_dir)), {KEY_A: "alpha"})
    async with asgi_client(app) as client:
        _, model_id = await _session_and_model(client)
        started = time.perf_counter()
        r = await client.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1), headers=_h())
        done = await _result(client, r.json()["request_id"])
        wall_ms = (time.perf_counter() - started) * 1000
        stages = parse_stages(done.headers[STAGES_HEADER])
        assert list(stages) == FORWARD_BACKWARD_STAGES
        assert stages["compute"] == 4.0 and stages["dispatch"] >= 10.0 - 4.0 - 0.5
        assert sum(stages.values()) <= wall_ms
        again = await _result(client, r.json()["request_id"])  # a retried retrieve: the same stages
        assert parse_stages(again.headers[STAGES_HEADER]) == stages
        r = await client.post(
            "/api/v1/optim_step",
            json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.1}},
            headers=_h(),
        )
        assert STAGES_HEADER not in (await _result(client, r.json()["request_id"])).headers


async def test_requests_are_counted_by_route_and_status(tmp_path: Path) -> None:
    app = double_app(tmp_path, DoubleRuntime(), {KEY_A: "alpha"})
    async with asgi_client(app) as client:
        for _ in range(2):
            assert (await client.post("/api/v1/create_session", json={}, headers=_h())).status_code == 200
        assert (await client.post("/api/v1/create_session", json={})).status_code == 401
        assert (await client.get("/api/v1/nope", headers=_h())).status_code == 404
        text = (await client.get("/metrics")).text
    assert 'miles_gateway_requests_total{route="/api/v1/create_session",status="200"} 2.0' in text
    assert 'miles_gateway_requests_total{route="/api/v1/create_session",status="401"} 1.0' in text
    assert 'miles_gateway_requests_total{route="unmatched",status="404"} 1.0' in text
