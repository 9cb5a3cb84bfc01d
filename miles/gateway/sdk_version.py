"""Which tinker SDK versions this gateway serves, read from the version header every SDK request carries.

The SDK sends `X-Stainless-Package-Version` on every request. Versions before protobuf became mandatory
(0.25.0: forward_backward's body) cannot be served at all: they get a 400 that says which version to
install. Versions other than the one this gateway is tested with are served, with the hosted service's
deprecation headers (`x-deprecation-note`, `x-deprecation-level`), which the SDK logs once per response:
an older one is asked to upgrade; a newer one is told that calls this gateway does not know are answered
as unsupported. Requests without the header (curl, the OpenAI routes) pass untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from miles.errors import Category, MilesError

# answers an error from middleware in the app's own style (miles.gateway.app.refuse)
Refuse = Callable[[Scope, Receive, Send, MilesError], Awaitable[None]]

HEADER = b"x-stainless-package-version"
MINIMUM = Version("0.25.0")  # protobuf forward_backward bodies (docs/gateway.md)
TESTED = Version("0.38.0")  # the SDK the suite runs against
INSTALL = f"pip install 'tinker=={TESTED}'"


@dataclass(frozen=True)
class SdkVerdict:
    refusal: str | None = None  # served not at all: the 400's message
    note: str | None = None  # served, with this deprecation note


def sdk_verdict(header: str | None) -> SdkVerdict:
    """What to do with a request whose SDK version header is `header` (pure)."""
    if header is None:
        return SdkVerdict()
    try:
        version = Version(header.strip())
    except InvalidVersion:
        return SdkVerdict(note=f"unreadable tinker SDK version {header[:40]!r}; this gateway's is {TESTED}")
    if version < MINIMUM:
        return SdkVerdict(
            refusal=f"tinker SDK {version} is too old for this gateway (it needs >= {MINIMUM}, the first "
            f"with protobuf requests); {INSTALL}"
        )
    if version.release[:2] < TESTED.release[:2]:
        return SdkVerdict(note=f"tinker SDK {version} is older than this gateway's ({TESTED}); {INSTALL}")
    if version.release[:2] > TESTED.release[:2]:
        return SdkVerdict(
            note=f"tinker SDK {version} is newer than this gateway's ({TESTED}): calls it does not know are "
            f"answered as unsupported; {INSTALL} for the tested pair"
        )
    return SdkVerdict()


class SdkVersionWindow:
    """Pure ASGI middleware over the Tinker routes (/api/v1/...)."""

    def __init__(self, app: ASGIApp, refuse: Refuse) -> None:
        self.app = app
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/v1/"):
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or ()).get(HEADER)
        verdict = sdk_verdict(raw.decode("latin-1") if raw is not None else None)
        if verdict.refusal is not None:
            await self.refuse(scope, receive, send, MilesError(verdict.refusal, category=Category.USER))
            return
        if verdict.note is None:
            await self.app(scope, receive, send)
            return
        note = verdict.note.encode("latin-1", "replace")

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (b"x-deprecation-note", note)]
                message = {**message, "headers": [*headers, (b"x-deprecation-level", b"warning")]}
            await send(message)

        await self.app(scope, receive, noting_send)
