"""Tinker handshake, sessions, capabilities, telemetry and future retrieval."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as tt
from tinker.types.try_again_response import TryAgainResponse

from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import not_found
from miles.gateway.stages import STAGES_HEADER
from miles.gateway.tinker.models import CreateSessionBody, FinishBody, RetrieveFutureBody, SessionBody
from miles.gateway.tinker.responses import sdk_json
from miles.state.futures import FutureState

router = APIRouter(prefix="/api/v1")
PROTOBUF = "application/x-protobuf"
COMPLETED_AT = "X-Miles-Completed-At"


@router.post("/client/config")
async def client_config(request: Request, tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    settings = gateway_of(request).settings
    config: dict[str, Any] = {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": settings.proto_compress_fwdbwd,
        "custom_loss_server_side": settings.custom_loss_server_side,
    }
    if settings.fwdbwd_max_chunk_len is not None:
        config["fwdbwd_max_chunk_len"] = settings.fwdbwd_max_chunk_len
    return config


@router.post("/client/dynamic_config")
async def dynamic_config(tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    return {}


@router.post("/telemetry")
async def telemetry(tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request, tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    cards = gateway_of(request).base_models.advertised()
    supported = [
        tt.SupportedModel(
            model_name=c.name,
            max_context_length=c.max_context,
            trainable=c.trainable,
            sampleable=c.sampleable,
        )
        for c in cards
    ]
    return sdk_json(tt.GetServerCapabilitiesResponse(supported_models=supported))


@router.post("/create_session")
async def create_session(
    body: CreateSessionBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    sid = await gateway_of(request).sessions.create(
        tenant, tags=body.tags, user_metadata=body.user_metadata or {}
    )
    return sdk_json(tt.CreateSessionResponse(session_id=sid))


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: SessionBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    await gateway_of(request).sessions.heartbeat(tenant, body.session_id)
    return sdk_json(tt.SessionHeartbeatResponse())


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, body: FinishBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    reason = body.reason.type if body.reason else None
    await gateway_of(request).sessions.finish(tenant, session_id, reason)
    return {"session_id": session_id, "status": "finished"}


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> Response:
    gw = gateway_of(request)
    future = await gw.futures.wait(tenant, body.request_id, gw.settings.long_poll_s)
    if future is None:
        raise not_found(f"future {body.request_id!r}")  # never reveal other tenants' ids
    if not future.done:
        return JSONResponse(
            content=sdk_json(TryAgainResponse(request_id=body.request_id, queue_state="active"))
        )
    # When the result was written: lets benchmarks and operators measure completion-to-client latency.
    done = {COMPLETED_AT: f"{future.updated_at:.6f}"}
    clock = gw.ops.stages.get(body.request_id)
    if clock is not None:
        if "notify" not in clock.stages:  # a second retrieve of the same future answers the same stages
            clock.mark("notify")
        done[STAGES_HEADER] = clock.header()
    if future.state is FutureState.FAILED:
        error = future.error
        if error is None:  # a failed future always records its error; "unknown" if one ever does not
            content: dict[str, Any] = {"error": None, "category": "unknown"}
        else:
            content = sdk_json(
                tt.RequestFailedResponse(error=error.message, category=error.category.reported)
            )
        return JSONResponse(content=content, headers=done)
    proto = future.result_bytes()
    if proto is not None:
        return Response(content=proto, media_type=PROTOBUF, headers=done)
    return Response(content=future.result_json or "{}", media_type="application/json", headers=done)
