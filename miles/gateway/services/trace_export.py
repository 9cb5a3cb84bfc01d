"""export_session_trace: a signed link to a session's trace (miles.gateway.traces), built when fetched.

The SDK polls `GET sessions/{id}/trace_export` until it answers `ready` with a URL, then downloads the URL
with a plain GET, no API key: the link is the credential, signed as external-weights links are
(`signed_urls`), for the session's owner only, valid for an hour.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from miles.gateway.errors import not_found
from miles.gateway.services import signed_urls
from miles.gateway.sessions import Sessions
from miles.gateway.traces import SessionTraces, chrome_trace
from miles.state.records import Clock

TRACE_PREFIX = "/api/v1/session_traces"
LINK_TTL_S = 3600.0


class TraceExport:
    def __init__(self, traces: SessionTraces, sessions: Sessions, *, clock: Clock = time.time) -> None:
        self._traces = traces
        self._sessions = sessions
        self._clock = clock
        self._key = secrets.token_bytes(32)

    async def poll(self, tenant: str, session_id: str, base_url: str) -> dict[str, Any]:
        """The SDK's poll answer for the owner's session (404 for anyone else's): ready, with the link."""
        await self._sessions.owned(tenant, session_id)
        expires = int(self._clock() + LINK_TTL_S)
        prefix = base_url.rstrip("/") + TRACE_PREFIX
        return {"status": "ready", "url": signed_urls.signed_path(prefix, session_id, self._key, expires)}

    def document(self, session_id: str, expires: int, signature: str) -> dict[str, Any]:
        """The trace a signed link names; a bad or expired signature is a 404, like a missing session."""
        if not signed_urls.is_valid(self._key, session_id, expires, signature, self._clock()):
            raise not_found("trace link (invalid or expired; call export_session_trace again)")
        return chrome_trace({f"session {session_id}": self._traces.spans(session_id)})
