"""Serving the app with uvicorn, and the event loop the gateway's process runs on.

The gateway parses HTTP with httptools and runs on uvloop: on the 2-core development box a forward_backward's
two HTTP exchanges against a server that does no work took 1.2-1.4 ms instead of 1.8-3.4 ms with uvicorn's
pure-Python h11 on the stock asyncio loop (bench/gateway_floors.py http; docs/gateway.md, issue 24).
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
import uvloop
from fastapi import FastAPI

from miles.errors import UserError

# Longer than any client's idle keep-alive, so the server never closes a connection a client is reusing.
KEEP_ALIVE_S = 75
# httptools: uvicorn's C parser (the `runtime` extra installs it); uvicorn's "auto" would silently fall back
# to h11 when it is missing
HTTP_PARSER = "httptools"
T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a uvloop loop: for processes that serve the gateway (the driver, the local
    server). uvicorn's own loop setting only applies to a loop uvicorn creates, and these processes create
    theirs."""
    return uvloop.run(main)


class GatewayTlsError(UserError):
    """The preset's TLS files cannot serve: the message names the file and what is wrong."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM certificate (chain) and private key: the gateway then serves https only."""

    certfile: str
    keyfile: str

    def problem(self) -> str | None:
        """What is wrong with the files, checked before serving (uvicorn's own error is an ssl traceback)."""
        for what, path in (("gateway.tls_certfile", self.certfile), ("gateway.tls_keyfile", self.keyfile)):
            if not os.access(path, os.R_OK):
                return f"{what} {path} is not a readable file"
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as exc:
            return f"gateway TLS files {self.certfile} / {self.keyfile} do not load: {exc}"
        return None


def gateway_server(app: FastAPI, host: str, port: int, tls: TlsFiles | None = None) -> uvicorn.Server:
    if tls is not None and (problem := tls.problem()):
        raise GatewayTlsError(problem)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=HTTP_PARSER,
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,
        ssl_certfile=tls.certfile if tls else None,
        ssl_keyfile=tls.keyfile if tls else None,
    )
    return uvicorn.Server(config)


async def serve_gateway(app: FastAPI, host: str, port: int, tls: TlsFiles | None = None) -> None:
    """Serve until the process is told to stop (SIGINT/SIGTERM)."""
    await gateway_server(app, host, port, tls).serve()


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside a driver that handles SIGTERM/SIGINT itself (orderly shutdown of Ray
    actors and engines first); stock uvicorn would capture the signal and re-raise it after serving."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def embedded_gateway_server(
    app: FastAPI, host: str, port: int, tls: TlsFiles | None = None
) -> EmbeddedServer:
    return EmbeddedServer(gateway_server(app, host, port, tls).config)
