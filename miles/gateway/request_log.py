"""Optional JSONL log of every request (method, path, status, wire headers, JSON body): conformance tests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

LOGGED_HEADERS = (
    "content-type",
    "content-encoding",
    "accept",
    "x-idempotency-key",
    "x-tinker-request-type",
    "x-tinker-request-iteration",
    "x-sdk-method",
)


def _forward_backward_summary(body: bytes, encoding: str | None) -> dict[str, Any]:
    from miles.gateway.tinker.codec import decode_forward_backward, decompress

    try:
        call = decode_forward_backward(decompress(body, encoding))
    except ValueError as exc:
        return {"error": str(exc)}
    return {
        "model_id": call.model_id,
        "seq_id": call.seq_id,
        "loss_fn": call.loss_fn,
        "loss_config": call.loss_config,
        "forward_only": call.forward_only,
        "num_datums": len(call.data),
        "inputs": sorted(call.data[0].loss_fn_inputs) if call.data else [],
    }


class RequestLog:
    """ASGI middleware; never logs API keys."""

    def __init__(self, app: Any, path: Path) -> None:
        self.app = app
        self.path = Path(path)
        self._lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        status: dict[str, Any] = {}

        async def logged_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        written = False

        def write_once() -> None:
            nonlocal written
            if not written:
                written = True
                self._write(scope, b"".join(chunks), status)

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                for key, value in message.get("headers", []):
                    if key.decode().lower() == "x-miles-completed-at":
                        status["completed_at"] = float(value.decode())
                    elif key.decode().lower() == "x-miles-stages":
                        status["stages"] = value.decode()
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                write_once()  # before the client can see the response: a reader of the log never misses it
            await send(message)

        try:
            await self.app(scope, logged_receive, logged_send)
        finally:
            write_once()

    def _write(self, scope: dict[str, Any], body: bytes, status: dict[str, Any]) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        entry: dict[str, Any] = {
            "t": time.time(),
            "method": scope["method"],
            "path": scope["path"],
            "status": status.get("code", 0),
            "headers": {k: headers[k] for k in LOGGED_HEADERS if k in headers},
        }
        if "completed_at" in status:
            entry["completed_at"] = status["completed_at"]
        if "stages" in status:
            entry["stages"] = status["stages"]
        if body and "json" in headers.get("content-type", ""):
            try:
                entry["json"] = json.loads(body)
            except ValueError:
                entry["body_bytes"] = len(body)
        elif body:
            entry["body_bytes"] = len(body)
            if scope["path"].endswith("/forward_backward"):
                entry["proto"] = _forward_backward_summary(body, headers.get("content-encoding"))
        with self._lock, self.path.open("a") as out:
            out.write(json.dumps(entry) + "\n")
