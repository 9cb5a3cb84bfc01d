"""The gateway's HTTP stack: httptools parses requests and the serving process runs on uvloop.

uvicorn's defaults ("auto") would quietly fall back to the pure-Python h11 parser and the stock asyncio loop
when either library is missing; docs/gateway.md measures what that costs per forward_backward.
"""

from __future__ import annotations

import asyncio

import httpx
import uvloop
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from miles.gateway.server import embedded_gateway_server, gateway_server, run_event_loop
from miles.utils.serving import free_port


def test_gateway_and_embedded_servers_parse_http_with_httptools() -> None:
    for server in (
        gateway_server(FastAPI(), "127.0.0.1", 0),
        embedded_gateway_server(FastAPI(), "127.0.0.1", 0),
    ):
        server.config.load()
        assert server.config.http_protocol_class is HttpToolsProtocol


def test_run_event_loop_serves_the_gateway_on_uvloop() -> None:
    app = FastAPI()

    @app.get("/loop")
    async def loop_type() -> dict[str, str]:
        return {"loop": type(asyncio.get_running_loop()).__module__}

    async def serve_and_ask() -> dict[str, str]:
        port = free_port()
        server = embedded_gateway_server(app, "127.0.0.1", port)
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient() as client:
                return (await client.get(f"http://127.0.0.1:{port}/loop")).json()
        finally:
            server.should_exit = True
            await serving

    assert run_event_loop(serve_and_ask()) == {"loop": uvloop.Loop.__module__}
