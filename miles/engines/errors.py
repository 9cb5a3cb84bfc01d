"""Errors raised by `SGLangApiClient` when an engine answers with a failure.

Transport failures (refused connection, reset, timeout) are NOT wrapped: they propagate as the httpx
exception (`httpx.ConnectError`, `httpx.ReadError`, ...) with a note naming the engine endpoint, so callers
can tell "the engine said no" (EngineError) from "we could not talk to the engine" (httpx.TransportError).
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """The engine answered an error status (or a failure body). `body` is its answer, verbatim."""

    def __init__(self, message: str, *, status_code: int, endpoint: str, body: Any) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.endpoint = endpoint
        self.body = body
        self.add_note(f"engine answer ({status_code} from {endpoint}): {body!r}")


class EngineRefused(EngineError):
    """The engine refused the operation: `success: false` (or a refused flush), whatever the status."""


class EngineUnauthorized(EngineError):
    """401/403: the API key is missing or wrong."""
