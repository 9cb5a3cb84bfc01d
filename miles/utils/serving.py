"""Run an ASGI app on uvicorn in a background thread on a free port (tests, tools, in-process engines)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


def bind_free_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening-ready TCP socket on a port the OS picked (no fixed ports: tests share the machine)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, in the ephemeral range: for a server bound at once. One bound later by
    another process can lose it meanwhile; use `miles.job.ports.claim_port` there, or `bind_free_socket`
    when this process serves."""
    with bind_free_socket(host) as sock:
        return int(sock.getsockname()[1])


class ServerThread:
    """`with ServerThread(app, timeout_keep_alive=5) as srv: srv.url` — uvicorn serving `app` until exit."""

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", timeout_keep_alive: int | float = 5, **config: Any
    ) -> None:
        self._sock = bind_free_socket(host)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        cfg = uvicorn.Config(
            app,
            timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]  # uvicorn accepts floats
            log_level=config.pop("log_level", "warning"),
            lifespan=config.pop("lifespan", "auto"),
            **config,
        )
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
