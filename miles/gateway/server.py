"""Serving the app with uvicorn."""

from __future__ import annotations

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
