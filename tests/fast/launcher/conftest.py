"""Fixtures shared by the launcher's tests."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

HEALTHZ_PATH = "/api/v1/healthz"


class HealthState:
    """What the stand-in gateway's healthz answers; tests switch `status` while it runs."""

    status = 200


@pytest.fixture
def health_server() -> Iterator[tuple[str, HealthState]]:
    """A gateway stand-in: `/api/v1/healthz` answers `state.status` (200 ok, else unavailable), other
    paths 404. Yields (base URL, state)."""
    state = HealthState()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = state.status == 200
            body = b'{"status":"ok"}' if ok else b'{"status":"unavailable","error":"gone"}'
            self.send_response(state.status if self.path == HEALTHZ_PATH else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


@pytest.fixture
def healthz(health_server: tuple[str, HealthState]) -> str:
    """The base URL of a stand-in gateway whose healthz answers 200."""
    return health_server[0]
