"""External weights uploads (tinker 0.39/0.40): start, a signed PUT per file, finish (services/uploads.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response

from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import bad_request
from miles.gateway.sdk_version import HEADER
from miles.gateway.services.uploads import PUT_PREFIX, LoraDeclaration
from miles.gateway.tinker.models import ExternalWeightsUploadFinishBody, ExternalWeightsUploadStartBody

router = APIRouter()


@router.post("/api/v1/external_weights_upload_start")
async def external_weights_upload_start(
    body: ExternalWeightsUploadStartBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    lora = body.lora_config
    if lora.rank < 1:
        raise bad_request("an external weights upload is a LoRA adapter: lora_config.rank must be >= 1")
    declared = LoraDeclaration(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
    return gateway_of(request).uploads.start(
        tenant,
        body.base_model,
        declared,
        body.destination_project_id,
        str(request.base_url),
        request.headers.get(HEADER.decode()),
    )


@router.put(PUT_PREFIX + "/{address:path}")
async def external_weights_upload_put(
    address: str, request: Request, expires: int = Query(...), signature: str = Query(...)
) -> Response:
    """A signed URL from the start: the signature is the credential (no API key)."""
    await gateway_of(request).uploads.receive(address, expires, signature, request.stream())
    return Response(status_code=200)


@router.post("/api/v1/external_weights_upload_finish")
async def external_weights_upload_finish(
    body: ExternalWeightsUploadFinishBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    return await gateway_of(request).uploads.finish(tenant, body.upload_id)
