"""Tinker REST extras: training runs, sessions, checkpoint listing, deletion, TTL, publishing, external
weights downloads, weights_info."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from tinker import types as tt

from miles.checkpoints.paths import CheckpointNotFound
from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import not_found
from miles.gateway.services.checkpoint_search import CheckpointSearch
from miles.gateway.services.runs import AccessScope
from miles.gateway.tinker.models import CheckpointTtlBody, WeightsInfoBody
from miles.gateway.tinker.responses import sdk_json
from miles.state.records import ModelRecord

router = APIRouter(prefix="/api/v1")


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat()


def training_run(model: ModelRecord) -> dict[str, Any]:
    return {
        "training_run_id": model.model_id,
        "base_model": model.base_model,
        "model_owner": model.tenant,
        "is_lora": model.is_lora,
        "corrupted": False,
        "lora_rank": model.lora_rank,
        "last_request_time": _iso(model.last_request_time),
        "last_checkpoint": model.last_checkpoint.to_tinker() if model.last_checkpoint else None,
        "last_sampler_checkpoint": (
            model.last_sampler_checkpoint.to_tinker() if model.last_sampler_checkpoint else None
        ),
        "user_metadata": {str(k): str(v) for k, v in model.user_metadata.items()} or None,
    }


@router.get("/training_runs")
async def list_training_runs(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    tenant: str = Depends(tinker_tenant),
) -> dict[str, Any]:
    models = sorted(await gateway_of(request).models.list(tenant=tenant), key=lambda m: m.created_at)
    page = models[offset : offset + limit]
    return {
        "training_runs": [training_run(m) for m in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(models)},
    }


@router.get("/training_runs/{model_id}")
async def get_training_run(
    model_id: str,
    request: Request,
    access_scope: AccessScope = Query("owned"),
    tenant: str = Depends(tinker_tenant),
) -> dict[str, Any]:
    """Also get_training_run_by_tinker_path (the SDK parses the run id out of the path)."""
    return training_run(await gateway_of(request).runs.training_run(tenant, model_id, access_scope))


@router.get("/training_runs/{model_id}/checkpoints")
async def list_run_checkpoints(
    model_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    gw = gateway_of(request)
    await gw.training.owned_model(tenant, model_id)
    records = await gw.checkpoints.list(tenant, model_id)
    return {"checkpoints": [r.to_tinker() for r in records], "cursor": None}


@router.get("/checkpoints")
async def list_user_checkpoints(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    tenant: str = Depends(tinker_tenant),
) -> dict[str, Any]:
    return await gateway_of(request).checkpoint_service.user_checkpoints(tenant, limit, offset)


@router.post("/checkpoints/search")
async def search_checkpoints(
    body: CheckpointSearch, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    """RestClient.search_checkpoints (tinker 0.39): filters, newest first, a cursor per page."""
    return await gateway_of(request).checkpoint_service.search(tenant, body)


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(
    request: Request, project_id: str | None = Query(None), tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    """AdminClient.get_current_checkpoint_storage_usage: the caller's checkpoints and the filesystem."""
    return await gateway_of(request).checkpoint_service.storage_usage(tenant, project_id)


# Registered before the DELETE of a checkpoint: its `{checkpoint_id:path}` would swallow `.../publish`.
@router.post("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish_checkpoint(
    model_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> Response:
    """Every tenant of this job may then read (load, sample, download) the checkpoint; 409 if it is."""
    await gateway_of(request).checkpoint_service.set_public(tenant, model_id, checkpoint_id, True)
    return Response(status_code=204)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish_checkpoint(
    model_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> Response:
    await gateway_of(request).checkpoint_service.set_public(tenant, model_id, checkpoint_id, False)
    return Response(status_code=204)


@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    model_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    service = gateway_of(request).checkpoint_service
    return await service.external_urls(tenant, model_id, checkpoint_id, str(request.base_url))


@router.get("/external_weights/{address:path}")
async def download_external_weights(
    address: str, request: Request, expires: int = Query(...), signature: str = Query(...)
) -> FileResponse:
    """A signed link from external_weights_urls: the signature is the credential (no API key)."""
    path = await gateway_of(request).checkpoint_service.download(address, expires, signature)
    return FileResponse(path, media_type="application/octet-stream", filename=path.name)


@router.get("/sessions")
async def list_sessions(
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    tenant: str = Depends(tinker_tenant),
) -> dict[str, Any]:
    return {"sessions": await gateway_of(request).runs.session_ids(tenant, limit, offset)}


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(
    session_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    """export_session_trace's poll: ready at once, with a signed link to the session's trace."""
    return await gateway_of(request).trace_export.poll(tenant, session_id, str(request.base_url))


@router.get("/session_traces/{session_id}")
async def download_session_trace(
    session_id: str, request: Request, expires: int = Query(...), signature: str = Query(...)
) -> JSONResponse:
    """A signed link from trace_export: the signature is the credential (no API key)."""
    document = gateway_of(request).trace_export.document(session_id, expires, signature)
    disposition = f'attachment; filename="{session_id}.trace.json"'
    return JSONResponse(document, headers={"Content-Disposition": disposition})


@router.get("/sessions/{session_id}")
async def get_session(
    session_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    return await gateway_of(request).runs.session(tenant, session_id)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    model_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> Response:
    try:
        await gateway_of(request).checkpoints.delete(tenant, model_id, checkpoint_id)
    except CheckpointNotFound as exc:
        raise not_found(f"checkpoint {checkpoint_id!r} of training run {model_id!r}") from exc
    return Response(status_code=204)


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(
    model_id: str,
    checkpoint_id: str,
    body: CheckpointTtlBody,
    request: Request,
    tenant: str = Depends(tinker_tenant),
) -> Response:
    """The SDK's `set_checkpoint_ttl_from_tinker_path`: the gateway's sweep deletes it once expired."""
    try:
        await gateway_of(request).checkpoints.set_ttl(tenant, model_id, checkpoint_id, body.ttl_seconds)
    except CheckpointNotFound as exc:
        raise not_found(f"checkpoint {checkpoint_id!r} of training run {model_id!r}") from exc
    return Response(status_code=204)


@router.post("/weights_info")
async def weights_info(
    body: WeightsInfoBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    _, info = await gateway_of(request).checkpoint_service.readable(tenant, body.tinker_path)
    weights = tt.WeightsInfoResponse(
        base_model=info.base_model or "", is_lora=bool(info.is_lora), lora_rank=info.lora_rank
    )
    return sdk_json(weights, optimizer_config={"type": "adamw"})
