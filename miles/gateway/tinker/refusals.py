"""Refused training requests do not leave a hole in their model's seq_id order.

The SDK numbers every training-client request (forward_backward chunks, optim_step, saves, ...) from one
counter and never resends a request the server refused with a 4xx. The gateway runs a model's operations
strictly in seq_id order, so a refused seq_id (an unknown route, a bad body, a refused optimizer) would
leave the next request waiting out `seq_gap_timeout_s` and then failing. This ASGI middleware reads the
(model_id, seq_id) of any refused POST under /api/v1/ and, when the caller owns that model, has the
model's queue skip the seq_id before the refusal is answered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from miles.errors import UserError
from miles.gateway.settings import DEFAULT_MAX_BODY_BYTES
from miles.gateway.tinker import codec
from miles.gateway.tinker.ids import is_identifier

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
# (api key or None, model_id, seq_id) -> whether a seq_id was skipped
Account = Callable[[str | None, str, int], Awaitable[bool]]

# 4xx answers the SDK does not retry with the same seq_id (401: the key is unknown, nothing to account).
_RETRIED_OR_ANONYMOUS = frozenset({401, 408, 409, 429})
# A refused body the route never read is read here only up to this size.
_MAX_UNREAD_BODY = 64 * 1024 * 1024


def is_refusal(status: int) -> bool:
    return 400 <= status < 500 and status not in _RETRIED_OR_ANONYMOUS


def training_call_of(
    body: bytes, content_type: str, content_encoding: str | None, max_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> tuple[str, int] | None:
    """(model_id, seq_id) of a training-client request body, JSON or forward_backward protobuf; or None.
    `max_bytes`: what a compressed body may decompress to (a refused zstd bomb stays refused here too)."""
    if content_type.startswith("application/x-protobuf"):
        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(codec.decompress(body, content_encoding, max_bytes=max_bytes))
        except (DecodeError, UserError):
            return None
        return (msg.model_id, int(msg.seq_id)) if is_identifier(msg.model_id) else None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    model_id, seq_id = data.get("model_id"), data.get("seq_id")
    if is_identifier(model_id) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
        return model_id, seq_id
    return None


class RefusedSeqIds:
    """Pure ASGI middleware: keeps the request body it forwards, and on a refusal accounts its seq_id."""

    def __init__(self, app: App, account: Account, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.account = account
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/api/v1/"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        body_done = False

        async def keeping_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                body_done = not message.get("more_body", False)
            return message

        async def accounting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and is_refusal(message["status"]):
                if not body_done:
                    await self._read_rest(scope, receive, chunks)
                await self._account(scope, b"".join(chunks))
            await send(message)

        await self.app(scope, keeping_receive, accounting_send)

    @staticmethod
    async def _read_rest(scope: Scope, receive: Receive, chunks: list[bytes]) -> None:
        # an unmatched route never reads its body; read it here unless it is too large to be a request
        length = _header(scope, b"content-length")
        if length is None or not length.isdigit() or int(length) > _MAX_UNREAD_BODY:
            return
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _account(self, scope: Scope, body: bytes) -> None:
        call = training_call_of(
            body,
            _header(scope, b"content-type") or "",
            _header(scope, b"content-encoding"),
            self.max_body_bytes,
        )
        if call is None:
            return
        try:
            await self.account(_header(scope, b"x-api-key"), *call)
        except Exception:  # the refusal is answered whatever happens here
            log.exception("accounting refused seq_id %s of model %s failed", call[1], call[0])


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
