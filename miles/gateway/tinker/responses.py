"""Small helpers for answering Tinker clients."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse


def future_response(request_id: str, *, model_id: str | None = None, **extra: Any) -> JSONResponse:
    body: dict[str, Any] = {"request_id": request_id}
    if model_id is not None:
        body["model_id"] = model_id
    body.update(extra)
    return JSONResponse(content=body)


def idempotency_key(request: Request) -> str | None:
    return request.headers.get("x-idempotency-key") or None
