"""The httpx client factory: per-loop caching, explicit limits, and idle connections never reused past 2 s."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from miles.utils.http import KEEPALIVE_EXPIRY_S, PROFILES, close_clients, get_async_client
from miles.utils.serving import ServerThread


def _pool(client: httpx.AsyncClient):
    return client._transport._pool  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def port_echo_server():
    app = FastAPI()

    @app.get("/port")
    async def port(request: Request) -> dict[str, int]:
        # The client's source port identifies the TCP connection the request came on.
        return {"port": request.client.port}

    # A long server keep-alive, so only the client's expiry can retire the connection.
    with ServerThread(app, timeout_keep_alive=60) as srv:
        yield srv


async def test_one_client_per_loop_and_purpose() -> None:
    engine = get_async_client()
    assert get_async_client(purpose="engine") is engine
    probe = get_async_client(purpose="probe")
    assert probe is not engine
    pool = _pool(engine)
    assert pool._keepalive_expiry == KEEPALIVE_EXPIRY_S == 2.0
    assert pool._max_connections == PROFILES["engine"].max_connections
    timeout = engine.timeout
    assert None not in (timeout.connect, timeout.write, timeout.pool)
    await close_clients()
    assert engine.is_closed and probe.is_closed
    fresh = get_async_client()
    assert fresh is not engine and not fresh.is_closed
    await close_clients()


def test_each_event_loop_gets_its_own_client() -> None:
    async def grab() -> httpx.AsyncClient:
        client = get_async_client()
        await close_clients()
        return client

    assert asyncio.run(grab()) is not asyncio.run(grab())


async def test_unknown_purpose_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown HTTP client purpose"):
        get_async_client(purpose="nope")


async def test_idle_connection_reused_only_below_expiry(port_echo_server: ServerThread) -> None:
    client = get_async_client()
    url = port_echo_server.url + "/port"
    try:
        first = (await client.get(url)).json()["port"]
        await asyncio.sleep(0.3)
        again = (await client.get(url)).json()["port"]
        assert again == first, "a connection idle well below the expiry should be reused"
        idle_since = time.monotonic()
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.3)
        assert time.monotonic() - idle_since > KEEPALIVE_EXPIRY_S
        after_gap = (await client.get(url)).json()["port"]
        assert after_gap != first, "a connection idle past 2 s must not be reused"
    finally:
        await close_clients()


async def test_engine_calls_never_go_through_an_http_proxy(
    port_echo_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    # HPC users export http_proxy for hub downloads; a proxy's 503 would look like a dead engine
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    client = get_async_client()
    try:
        assert (await client.get(port_echo_server.url + "/port")).status_code == 200
    finally:
        await close_clients()
