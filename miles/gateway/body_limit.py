"""Request bodies over `GatewaySettings.max_body_bytes` are refused with 413 and a JSON body, unread.

A declared Content-Length over the limit is answered before the app runs (no body byte is read, no key is
checked: an unauthenticated client cannot make the gateway buffer anything). A body without one (chunked)
is read here up to the limit and replayed to the app as one message, so what the routes read is bounded
whichever way the client frames it. Pure ASGI, so the routes' streaming reads stay as they are otherwise.

Routes that stream a large body to disk under a bound of their own (`streamed`: path prefixes, e.g. the
external weights upload PUT) pass through unread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp as App
from starlette.types import Message, Receive, Scope, Send

from miles.errors import TooLargeError

# answers `error` on (scope, receive, send) in the gateway's error style (Tinker or OpenAI body)
Refuse = Callable[[Scope, Receive, Send, TooLargeError], Awaitable[None]]


def too_large(limit: int, size: int | None = None) -> TooLargeError:
    got = "" if size is None else f" ({size} bytes)"
    return TooLargeError(
        f"request body too large{got}: this gateway takes at most {limit} bytes per request "
        "(gateway setting max_body_bytes); send the batch in smaller requests"
    )


def declared_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


class BodySizeLimit:
    def __init__(self, app: App, *, max_bytes: int, refuse: Refuse, streamed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse
        self.streamed = streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.streamed):
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await self.refuse(scope, receive, send, too_large(self.max_bytes, length))
                return
            await self.app(scope, receive, send)  # the server never delivers more than Content-Length
            return
        body = await self._read_bounded(receive)
        if body is None:
            await self.refuse(scope, receive, send, too_large(self.max_bytes))
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit. A client that goes away mid-body leaves
        what came (the app then reads a short body and refuses it, to nobody)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would

    return replay
