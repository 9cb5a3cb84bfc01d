"""Counts answered requests by route and status (`miles_gateway_requests_total`).

Pure ASGI: Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) runs every request through a task
group and memory streams, which cost a forward_backward's submit and its retrieve a measurable share of
the gateway's overhead (docs/gateway.md, performance). The route is read after the app ran: the router
writes it into the scope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from miles.gateway.metrics import GatewayMetrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class CountRequests:
    def __init__(self, app: App, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, noting_send)
        if status:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status[0])).inc()
