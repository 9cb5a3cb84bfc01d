"""Serving the app with uvicorn."""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI

# Longer than any client's idle keep-alive, so the server never closes a connection a client is reusing.
KEEP_ALIVE_S = 75


def gateway_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S, access_log=False
    )
    return uvicorn.Server(config)


async def serve_gateway(app: FastAPI, host: str, port: int) -> None:
    """Serve until the process is told to stop (SIGINT/SIGTERM)."""
    await gateway_server(app, host, port).serve()


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside a driver that handles SIGTERM/SIGINT itself (orderly shutdown of Ray
    actors and engines first); stock uvicorn would capture the signal and re-raise it after serving."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def embedded_gateway_server(app: FastAPI, host: str, port: int) -> EmbeddedServer:
    return EmbeddedServer(gateway_server(app, host, port).config)
