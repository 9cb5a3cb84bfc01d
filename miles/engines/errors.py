"""Engine errors: what `SGLangApiClient` raises when an engine answers with a failure, and what the CPU
engine raises to refuse an operation (its HTTP layer answers SGLang's failure body, the client raises the
same `EngineRefused` again on its side).

Transport failures (refused connection, reset, timeout) are NOT wrapped: they propagate as the httpx
exception (`httpx.ConnectError`, `httpx.ReadError`, ...) with a note naming the engine endpoint, so callers
can tell "the engine said no" (EngineError) from "we could not talk to the engine" (httpx.TransportError).
"""

from __future__ import annotations

from typing import Any

from miles.errors import MilesError


class EngineError(MilesError):
    """The engine answered an error status (or a failure body). `body` is its answer, verbatim; the
    three are None where the engine itself raises (the CPU engine, before any answer exists)."""

    def __init__(
        self, message: str, *, status_code: int | None = None, endpoint: str | None = None, body: Any = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.endpoint = endpoint
        self.body = body
        if status_code is not None:
            self.add_note(f"engine answer ({status_code} from {endpoint}): {body!r}")


class EngineRefused(EngineError):
    """The engine refused the operation: `success: false` (or a refused flush), whatever the status.
    The CPU engine raises it to refuse; its HTTP layer turns it into SGLang's failure body (400)."""


class EngineUnauthorized(EngineError):
    """401/403: the API key is missing or wrong."""
