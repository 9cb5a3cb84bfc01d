"""Redis gone for about 10 s under a serving gateway: 503 with a reason, no hang, no 500, and back by itself.

A gateway process over the local runtime (tiny model, CPU engine) keeps its state in a private
redis-server (its own port: pausing or stopping the shared one would break other tests). Two outages:
Redis hung (CLIENT PAUSE: connections accepted, nothing answered) and Redis stopped (saved, then started
again on the same port). During each, the gateway answers 503 naming the state store, well before the
outage ends, and healthz stays 200 ("degraded"), so the job's watchdog does not end the job. Afterwards
the same gateway process serves again, with the state from before, and a call the SDK sent during the
outage completes (the SDK retries 503s).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import tinker
from tinker import types

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_gateway
from miles.state.local_redis import LocalRedisServer

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY = "tml-outage-alpha-0001"
STORE_TIMEOUT_S = 1.0  # the gateway's bound on one Redis call (the state URL's socket_timeout)
PAUSE_S = 10.0
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
)


def _requests(model_id: str, request_id: str) -> list[tuple[str, str, dict | None]]:
    """(method, path, JSON body) of routes that need the store, Tinker and OpenAI."""
    session_id = model_id.split(":")[0]
    return [
        ("POST", "/api/v1/get_info", {"model_id": model_id}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": session_id}),
        ("POST", "/api/v1/retrieve_future", {"request_id": request_id}),
        ("POST", "/api/v1/create_session", {"tags": []}),
        ("GET", f"/api/v1/training_runs/{model_id}", None),
        ("GET", "/v1/models", None),
    ]


def _send(url: str, method: str, path: str, body: dict | None) -> tuple[httpx.Response, float]:
    headers = {"X-API-Key": KEY, "Authorization": f"Bearer {KEY}"}
    started = time.monotonic()
    # The client's own timeout is far above the outage: a hang shows as an answer after the outage.
    r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)
    return r, time.monotonic() - started


def _check_outage_answers(gateway: GatewayProcess, model_id: str, request_id: str, ends_at: float) -> list:
    requests = _requests(model_id, request_id)
    with ThreadPoolExecutor(len(requests)) as pool:  # at once, as clients would: the outage is short
        answers = list(pool.map(lambda req: _send(gateway.url, *req), requests))
    took = [(path, round(seconds, 2)) for (_, path, _), (_, seconds) in zip(requests, answers, strict=True)]
    for (_, path, _), (r, _) in zip(requests, answers, strict=True):
        assert r.status_code == 503, (path, r.status_code, r.text)
        error = r.json()["error"] if path.startswith("/v1/") else r.json()
        kind, message = error["type"], error.get("detail") or error.get("message")
        assert kind == "state_store_unavailable" and "state store" in message, (path, r.text)
        assert "127.0.0.1" not in message, "the store's address is not the client's business"
    health = httpx.get(f"{gateway.url}/api/v1/healthz", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert "state store" in health.json()["state_store"]
    assert time.monotonic() < ends_at, f"answers came only after the outage ended: {took}"
    return took


def _serves_again(gateway: GatewayProcess, tc: tinker.TrainingClient) -> None:
    info = _send(gateway.url, "POST", "/api/v1/get_info", {"model_id": tc.model_id})[0]
    assert info.status_code == 200 and info.json()["lora_rank"] == 4, info.text
    assert httpx.get(f"{gateway.url}/api/v1/healthz", timeout=30).json() == {"status": "ok"}
    out = tc.forward_backward([DATUM], "cross_entropy").result(timeout=60)
    assert len(out.loss_fn_outputs) == 1


def _finished_request_id(gateway: GatewayProcess) -> str:
    polls = [r for r in gateway.requests() if r["path"].endswith("/retrieve_future") and r.get("json")]
    return polls[-1]["json"]["request_id"]


def test_redis_outages_are_503s_with_a_reason_and_the_gateway_recovers_by_itself(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = LocalRedisServer(redis_dir)
    server.start()
    state_url = f"{server.url}?socket_timeout={STORE_TIMEOUT_S:g}"
    flags = ("--state-url", state_url, "--state-key-prefix", "outage", "--long-poll-s", "3")
    gateway = start_gateway(tiny_model_dir, tmp_path / "gw", {KEY: "alpha"}, *flags)
    try:
        service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        tc.forward_backward([DATUM], "cross_entropy").result()
        request_id = _finished_request_id(gateway)

        # 1. Redis hung: connections are accepted and nothing is answered for PAUSE_S.
        with redis.Redis.from_url(server.url) as admin:
            admin.execute_command("CLIENT", "PAUSE", str(int(PAUSE_S * 1000)), "ALL")
        ends_at = time.monotonic() + PAUSE_S
        hung = _check_outage_answers(gateway, tc.model_id, request_id, ends_at)
        time.sleep(max(0.0, ends_at - time.monotonic()) + 0.2)
        _serves_again(gateway, tc)

        # 2. Redis stopped (its data saved), started again on the same port ~PAUSE_S later. A call the
        # SDK sends meanwhile is answered 503 and retried by the SDK until it goes through.
        server.stop(save=True)
        ends_at = time.monotonic() + PAUSE_S
        gone = _check_outage_answers(gateway, tc.model_id, request_id, ends_at)
        restart = threading.Timer(max(0.0, ends_at - time.monotonic()), server.start)
        restart.start()
        during = tc.forward_backward([DATUM], "cross_entropy")
        assert len(during.result(timeout=120).loss_fn_outputs) == 1
        restart.join()
        _serves_again(gateway, tc)
        print(f"answers while Redis hung: {hung}; while Redis was stopped: {gone}")
        assert gateway.proc.poll() is None, "the gateway process is the one from before the outages"
    finally:
        gateway.stop()
        server.stop()
