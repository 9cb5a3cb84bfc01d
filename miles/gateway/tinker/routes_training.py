"""Tinker training endpoints: parse the body, hand it to the training service, answer with the future."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as tt

from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import bad_request
from miles.gateway.stages import StageClock
from miles.gateway.tinker import codec
from miles.gateway.tinker.models import (
    CopyWeightsBody,
    CreateCustomLossBody,
    CreateModelBody,
    LoadWeightsBody,
    ModelBody,
    OptimStepBody,
    SaveForSamplerBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
)
from miles.gateway.tinker.responses import future_response, idempotency_key, sdk_json
from miles.types import AdamParams, LoraSpec

router = APIRouter(prefix="/api/v1")
WEIGHTS_ACCESS_TOKEN_HEADER = "X-Tinker-Weights-Access-Token"
# create_lora_training_client(rank=0): the SDK's only creator, asking for full fine-tuning
FULL_FINE_TUNING_RANK = 0


def _lora_spec(body: CreateModelBody) -> LoraSpec | None:
    """The adapter to train; None asks for full fine-tuning (no lora_config, or rank 0)."""
    cfg = body.lora_config
    if cfg is None or cfg.rank == FULL_FINE_TUNING_RANK:
        return None
    return LoraSpec(
        rank=cfg.rank,
        seed=cfg.seed,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


@router.post("/create_model")
async def create_model(
    body: CreateModelBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    training = gateway_of(request).training
    request_id, model_id = await training.create_model(
        tenant,
        body.session_id,
        body.model_seq_id,
        body.base_model,
        _lora_spec(body),
        body.user_metadata,
        idempotency_key(request),
    )
    return future_response(request_id, model_id=model_id)


@router.post("/create_custom_loss")
async def create_custom_loss(
    body: CreateCustomLossBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    request_id = await gateway_of(request).custom_losses.create(
        tenant,
        body.session_id,
        body.custom_loss_seq_id,
        body.name,
        body.inputs,
        body.graph,
        idempotency_key(request),
    )
    return future_response(request_id)


@router.post("/copy_weights")
async def copy_weights(
    body: CopyWeightsBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    """A copy of a readable checkpoint in a new training run of the caller's (answered directly)."""
    if request.headers.get(WEIGHTS_ACCESS_TOKEN_HEADER):
        raise bad_request(
            "weights_access_token is not used here: a checkpoint of another key of this job is readable once "
            "its owner publishes it (publish_checkpoint_from_tinker_path); copy it then without a token"
        )
    path = await gateway_of(request).training.copy_weights(
        tenant,
        body.source_path,
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        project_id=body.destination_project_id,
        ttl_seconds=body.ttl_seconds,
        key=idempotency_key(request),
    )
    return sdk_json(tt.CopyWeightsResponse(tinker_path=path))


@router.post("/get_info")
async def get_info(body: ModelBody, request: Request, tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    gw = gateway_of(request)
    model = await gw.training.owned_model(tenant, body.model_id)
    card = gw.base_models.cards().get(model.base_model)
    info = tt.GetInfoResponse(
        type="get_info",
        model_id=model.model_id,
        model_data=tt.ModelData(
            arch=card.arch if card else None,
            model_name=model.base_model,
            tokenizer_id=card.tokenizer_id if card else model.base_model,
        ),
        is_lora=model.is_lora,
        lora_rank=model.lora_rank,
        model_name=model.base_model,
    )
    return sdk_json(info, optimizer_config={"type": "adamw"})


@router.post("/unload_model")
async def unload_model(
    body: ModelBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    training = gateway_of(request).training
    request_id = await training.unload_model(tenant, body.model_id, idempotency_key(request))
    return future_response(request_id, model_id=body.model_id)


@router.post("/forward_backward")
async def forward_backward(request: Request, tenant: str = Depends(tinker_tenant)) -> JSONResponse:
    # a malformed body is a UserError (400), one over max_body_bytes once decoded a TooLargeError (413)
    clock = StageClock()
    limit = gateway_of(request).settings.max_body_bytes
    body = await request.body()
    clock.mark("http_in")
    raw = codec.decompress(body, request.headers.get("content-encoding"), max_bytes=limit)
    call = codec.decode_forward_backward(raw, max_bytes=limit)
    clock.mark("decode")
    training = gateway_of(request).training
    request_id = await training.forward_backward(tenant, call, idempotency_key(request), clock)
    return future_response(request_id, model_id=call.model_id)


@router.post("/optim_step")
async def optim_step(
    body: OptimStepBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    training = gateway_of(request).training
    await training.owned_model(tenant, body.model_id)
    p = body.adam_params
    if body.optimizer_params is not None or p is None or p.type not in (None, "adam", "adamw"):
        kind = (body.optimizer_params or {}).get("type") or (p.type if p is not None else None)
        raise bad_request(
            f"only Adam optimizer parameters (adam_params) are supported; got {kind or 'none'}: models "
            "here train with AdamW (get_info's optimizer_config)"
        )
    adam = AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
    request_id = await training.optim_step(tenant, body.model_id, body.seq_id, adam, idempotency_key(request))
    return future_response(request_id, model_id=body.model_id)


@router.post("/save_weights")
async def save_weights(
    body: SaveWeightsBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    request_id = await gateway_of(request).training.save_weights(
        tenant,
        body.model_id,
        body.seq_id,
        body.path,
        overwrite=body.overwrite,
        ttl_seconds=body.ttl_seconds,
        user_metadata=body.user_metadata,
        key=idempotency_key(request),
    )
    return future_response(request_id, model_id=body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveForSamplerBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    request_id = await gateway_of(request).training.save_for_sampler(
        tenant,
        body.model_id,
        body.seq_id,
        body.path,
        body.sampling_session_seq_id,
        idempotency_key(request),
        kind=body.kind,
        ttl_seconds=body.ttl_seconds,
        user_metadata=body.user_metadata,
    )
    return future_response(request_id, model_id=body.model_id)


@router.post("/save_weights_external")
async def save_weights_external(
    body: SaveWeightsExternalBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    if body.age_encryption_recipients:
        # refused before queueing: the refusal middleware accounts the seq_id, the SDK's order goes on
        raise bad_request(
            "age_encryption_recipients is not supported by this server: exports are written unencrypted "
            "under the job's run directory and served only through signed links; leave it unset"
        )
    request_id = await gateway_of(request).training.save_external(
        tenant,
        body.model_id,
        body.seq_id,
        body.path,
        ttl_seconds=body.ttl_seconds,
        key=idempotency_key(request),
    )
    return future_response(request_id, model_id=body.model_id)


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    training = gateway_of(request).training
    key = idempotency_key(request)
    if body.session_id is not None and body.model_seq_id is not None:
        request_id, model_id = await training.create_from_checkpoint(
            tenant, body.session_id, body.model_seq_id, body.path, body.optimizer, key
        )
        return future_response(request_id, model_id=model_id)
    if body.model_id is None:
        raise bad_request("load_weights needs model_id, or session_id with model_seq_id")
    request_id = await training.load_weights(
        tenant, body.model_id, body.seq_id, body.path, body.optimizer, key
    )
    return future_response(request_id, model_id=body.model_id)
