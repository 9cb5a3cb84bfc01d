"""Small helpers for answering Tinker clients."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel


def future_response(request_id: str, *, model_id: str | None = None, **extra: Any) -> JSONResponse:
    body: dict[str, Any] = {"request_id": request_id}
    if model_id is not None:
        body["model_id"] = model_id
    body.update(extra)
    return JSONResponse(content=body)


def idempotency_key(request: Request) -> str | None:
    return request.headers.get("x-idempotency-key") or None


def sdk_json(response: BaseModel, **extra: Any) -> dict[str, Any]:
    """A `tinker.types` response model as the JSON it is sent as: the fields it was built with (the SDK's
    optional fields we never fill stay absent), their defaults such as `type` included, plus `extra`."""
    body = response.model_dump(mode="json", exclude_unset=True)
    kind = getattr(response, "type", None)
    if kind is not None:
        body.setdefault("type", kind)  # a Literal default (e.g. "create_model") is part of the answer
    body.update(extra)
    return body
