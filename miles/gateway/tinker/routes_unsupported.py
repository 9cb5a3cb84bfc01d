"""SDK routes that cannot apply to a self-hosted job: each is answered 400 with the reason and what to use
instead, rather than an unexplained 404 (a 400 is not retried by the SDK). docs/gateway.md lists them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from miles.gateway.context import tinker_tenant
from miles.gateway.errors import bad_request

router = APIRouter(prefix="/api/v1")

# (method, path, SDK method, why not here and what to use instead)
UNSUPPORTED: tuple[tuple[str, str, str, str], ...] = (
    (
        "PUT",
        "/sessions/{session_id}/project",
        "assign_session_project",
        "this job has no projects; sessions belong to the API key that created them",
    ),
    (
        "POST",
        "/sessions/search",
        "search_sessions",
        "there is no organization-wide session search here; use list_sessions and get_session",
    ),
    ("GET", "/audit", "get_audit_log", "this job keeps no organization audit log"),
    ("GET", "/billing/usage/events", "get_billing_usage", "a self-hosted job has no billing"),
)


def _refusal(sdk_method: str, reason: str):
    async def refuse(tenant: str = Depends(tinker_tenant)) -> None:
        raise bad_request(f"{sdk_method} is not supported by this self-hosted gateway: {reason}")

    refuse.__name__ = f"unsupported_{sdk_method}"
    return refuse


for _method, _path, _sdk_method, _reason in UNSUPPORTED:
    router.add_api_route(_path, _refusal(_sdk_method, _reason), methods=[_method])
