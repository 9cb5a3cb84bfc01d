"""`launcher trace RUN`: one trace of a running job, for ui.perfetto.dev (offline) or chrome://tracing.

Every session of the job's API key is fetched the way the SDK's `export_session_trace` fetches one (poll
`sessions/{id}/trace_export`, then GET the signed link), and the documents are merged into one Chrome
trace-event document with a process per session. The gateway records the spans (miles/gateway/traces.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from miles.contract.tls import pinned_tls

TIMEOUT_S = 30.0
MAX_SESSIONS = 1000


class TraceError(RuntimeError):
    """The gateway could not be asked, or answered something else than a trace."""


def merge_traces(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One document from several: each document's processes get pids of their own, in order."""
    events: list[dict[str, Any]] = []
    offset = 0
    for document in documents:
        pids = sorted({event["pid"] for event in document.get("traceEvents", [])})
        renumber = {pid: offset + n for n, pid in enumerate(pids, start=1)}
        events.extend({**event, "pid": renumber[event["pid"]]} for event in document.get("traceEvents", []))
        offset += len(pids)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def fetch_job_trace(base_url: str, api_key: str, tls_cert: Path | None = None) -> tuple[dict[str, Any], int]:
    """(the merged trace of every session the key owns, how many sessions)."""
    headers = {"X-API-Key": api_key}
    try:
        verify = pinned_tls(tls_cert) if tls_cert is not None else True
        with httpx.Client(
            base_url=base_url, headers=headers, verify=verify, trust_env=False, timeout=TIMEOUT_S
        ) as client:
            listed = _json(client.get("/api/v1/sessions", params={"limit": MAX_SESSIONS}))
            documents = []
            for session_id in listed.get("sessions", []):
                link = _json(client.get(f"/api/v1/sessions/{session_id}/trace_export"))
                if link.get("status") != "ready" or not link.get("url"):
                    raise TraceError(f"the gateway did not give a trace of session {session_id}: {link}")
                documents.append(_json(client.get(link["url"])))  # the signed link needs no key
    except (httpx.HTTPError, OSError) as exc:  # OSError: the gateway's certificate cannot be read
        raise TraceError(f"could not reach the gateway at {base_url}: {type(exc).__name__}: {exc}") from exc
    return merge_traces(documents), len(documents)


def _json(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        request = response.request
        raise TraceError(f"{request.method} {request.url.path}: {response.status_code} {response.text[:300]}")
    return response.json()
