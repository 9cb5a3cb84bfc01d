"""A stand-in driver for system tests: serves the gateway's healthz as the real driver would.

It binds the address of MILES_GATEWAY_URL (the job script exports it) and answers
`GET /api/v1/healthz` (and `/health`) with 200 until the file `$MILES_RUN_DIR/driver-dead` exists,
then with the runtime's 503 body. Standard library only: it starts in well under a second.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

HEALTH_PATHS = ("/api/v1/healthz", "/health")
DEAD_FLAG = "driver-dead"


def make_handler(dead_flag: Path) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in HEALTH_PATHS:
                self._answer(404, {"error": f"no route {self.path}"})
            elif dead_flag.exists():
                self._answer(503, {"status": "unavailable", "error": "test: no trainer cell alive"})
            else:
                self._answer(200, {"status": "ok"})

        def _answer(self, status: int, body: dict[str, str]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: object) -> None:
            pass

    return Handler


def main() -> int:
    url = urlsplit(os.environ["MILES_GATEWAY_URL"])
    run_dir = Path(os.environ["MILES_RUN_DIR"])
    server = http.server.ThreadingHTTPServer(
        (url.hostname or "127.0.0.1", url.port or 80), make_handler(run_dir / DEAD_FLAG)
    )
    print(f"fake driver: serving healthz on {url.geturl()} (pid {os.getpid()})", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
