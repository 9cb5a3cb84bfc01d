"""Tinker training endpoints: every compute call is a future, executed in seq_id order per model."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from miles.checkpoints.manager import CheckpointHandle
from miles.checkpoints.paths import CheckpointNotFound
from miles.gateway.context import Gateway, gateway_of, tinker_tenant
from miles.gateway.errors import bad_request, not_found
from miles.gateway.sessions import model_id_for, sampler_id_for, session_of
from miles.gateway.tinker import codec
from miles.gateway.tinker.models import (
    CreateModelBody,
    LoadWeightsBody,
    ModelBody,
    OptimStepBody,
    SaveForSamplerBody,
    SaveWeightsBody,
)
from miles.gateway.tinker.responses import future_response, idempotency_key
from miles.runtime.api import SamplerTarget
from miles.state.records import ModelRecord, SamplerRecord
from miles.types import SUPPORTED_LOSSES, AdamParams, LoraSpec, UserError

router = APIRouter(prefix="/api/v1")


def _lora_spec(body: CreateModelBody) -> LoraSpec | None:
    cfg = body.lora_config
    if cfg is None:
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
    gw = gateway_of(request)
    gw.card(body.base_model, for_training=True)
    await gw.sessions.require_active(tenant, body.session_id)
    model_id = model_id_for(body.session_id, body.model_seq_id)
    lora = _lora_spec(body)

    async def op() -> dict[str, Any]:
        await gw.runtime.create_model(model_id, body.base_model, lora)
        return {"model_id": model_id, "type": "create_model"}

    request_id = await _submit_create(
        gw, tenant, model_id, body.base_model, lora, body.user_metadata, request, op
    )
    return future_response(request_id, model_id=model_id)


async def _submit_create(gw: Gateway, tenant, model_id, base_model, lora, user_metadata, request, op) -> str:
    if await gw.models.get_owned(tenant, model_id) is None:
        now = time.time()
        await gw.models.save(
            ModelRecord(
                model_id=model_id,
                tenant=tenant,
                session_id=session_of(model_id),
                base_model=base_model,
                is_lora=lora is not None,
                lora_rank=None if lora is None else lora.rank,
                train_mode="lora" if lora is not None else "full",
                created_at=now,
                last_request_time=now,
                user_metadata=user_metadata or {},
            )
        )

    async def guarded() -> dict[str, Any]:
        try:
            return await op()
        except BaseException:
            await gw.models.delete(model_id)
            raise

    return await gw.ops.submit_ordered(
        tenant=tenant,
        kind="CreateModel",
        model_id=model_id,
        seq_id=0,
        idempotency_key=idempotency_key(request),
        operation=guarded,
    )


@router.post("/get_info")
async def get_info(body: ModelBody, request: Request, tenant: str = Depends(tinker_tenant)) -> dict[str, Any]:
    gw = gateway_of(request)
    model = await gw.owned_model(tenant, body.model_id)
    card = gw.cards().get(model.base_model)
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {
            "arch": card.arch if card else None,
            "model_name": model.base_model,
            "tokenizer_id": card.tokenizer_id if card else model.base_model,
        },
        "is_lora": model.is_lora,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/unload_model")
async def unload_model(
    body: ModelBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    gw = gateway_of(request)
    await gw.owned_model(tenant, body.model_id)

    async def op() -> dict[str, Any]:
        await gw.runtime.release_model(body.model_id)
        await gw.models.delete(body.model_id)
        return {"model_id": body.model_id, "type": "unload_model"}

    request_id = await _ordered(gw, request, tenant, "UnloadModel", body.model_id, None, op)
    return future_response(request_id, model_id=body.model_id)


async def _owned_model(gw: Gateway, tenant: str, model_id: str) -> ModelRecord:
    model = await gw.owned_model(tenant, model_id)
    await gw.models.touch(model_id)
    return model


async def _ordered(gw: Gateway, request: Request, tenant: str, kind: str, model_id: str, seq_id, op) -> str:
    # A gateway restarted on a persistent store knows the model but has no queue: start at this seq_id.
    first_seq = 0 if gw.ops.has_queue(model_id) or seq_id is None else seq_id
    return await gw.ops.submit_ordered(
        tenant=tenant,
        kind=kind,
        model_id=model_id,
        seq_id=seq_id,
        idempotency_key=idempotency_key(request),
        operation=op,
        first_seq=first_seq,
    )


@router.post("/forward_backward")
async def forward_backward(request: Request, tenant: str = Depends(tinker_tenant)) -> JSONResponse:
    gw = gateway_of(request)
    try:
        raw = codec.decompress(await request.body(), request.headers.get("content-encoding"))
        call = codec.decode_forward_backward(raw)
    except UserError as exc:
        raise bad_request(str(exc)) from exc
    await _owned_model(gw, tenant, call.model_id)

    async def op() -> bytes:
        if call.loss_fn not in SUPPORTED_LOSSES:
            raise UserError(
                f"loss_fn {call.loss_fn!r} is not supported; use one of {', '.join(SUPPORTED_LOSSES)}"
            )
        if not call.data:
            raise UserError("forward_backward needs at least one datum")
        out = await gw.runtime.forward_backward(
            call.model_id, call.data, call.loss_fn, call.loss_config, call.forward_only
        )
        return codec.encode_forward_backward_output(out)

    kind = "Forward" if call.forward_only else "ForwardBackward"
    request_id = await _ordered(gw, request, tenant, kind, call.model_id, call.seq_id, op)
    return future_response(request_id, model_id=call.model_id)


@router.post("/optim_step")
async def optim_step(
    body: OptimStepBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    gw = gateway_of(request)
    await _owned_model(gw, tenant, body.model_id)
    if body.optimizer_params is not None or (body.adam_params.type not in (None, "adam", "adamw")):
        raise bad_request("only Adam optimizer parameters (adam_params) are supported")
    p = body.adam_params
    adam = AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)

    async def op() -> dict[str, Any]:
        metrics = await gw.runtime.optim_step(body.model_id, adam)
        return {"metrics": {k: float(v) for k, v in (metrics or {}).items()}, "type": "optim_step"}

    request_id = await _ordered(gw, request, tenant, "OptimStep", body.model_id, body.seq_id, op)
    return future_response(request_id, model_id=body.model_id)


def _commit_metadata(model: ModelRecord, has_optimizer: bool) -> dict[str, Any]:
    return {
        "has_optimizer": has_optimizer,
        "base_model": model.base_model,
        "is_lora": model.is_lora,
        "lora_rank": model.lora_rank,
    }


async def _save(gw: Gateway, handle: CheckpointHandle, write, metadata: dict[str, Any]) -> str:
    try:
        await write(handle.path)
    except BaseException:
        await gw.checkpoints.abort(handle)
        raise
    await gw.checkpoints.commit(handle, metadata)
    return handle.tinker_path


@router.post("/save_weights")
async def save_weights(
    body: SaveWeightsBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    gw = gateway_of(request)
    model = await _owned_model(gw, tenant, body.model_id)

    async def op() -> dict[str, Any]:
        handle = await gw.checkpoints.allocate(
            tenant,
            body.model_id,
            "weights",
            body.path,
            overwrite=body.overwrite,
            ttl_seconds=body.ttl_seconds,
        )

        async def write(path) -> None:
            await gw.runtime.save_state(body.model_id, path, True)

        path = await _save(gw, handle, write, _commit_metadata(model, True))
        return {"path": path, "type": "save_weights"}

    request_id = await _ordered(gw, request, tenant, "SaveWeights", body.model_id, body.seq_id, op)
    return future_response(request_id, model_id=body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveForSamplerBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    gw = gateway_of(request)
    model = await _owned_model(gw, tenant, body.model_id)
    if body.path is None and body.sampling_session_seq_id is None:
        raise bad_request("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
    session_id = model.session_id

    async def op() -> dict[str, Any]:
        handle = await gw.checkpoints.allocate(tenant, body.model_id, "sampler_weights", body.path)

        async def write(path) -> None:
            await gw.runtime.save_for_sampler(body.model_id, path)

        path = await _save(gw, handle, write, _commit_metadata(model, False))
        # engines load the committed, immutable directory (never the staging one the files were written to)
        snapshot = SamplerTarget(
            model.base_model, snapshot_path=await gw.checkpoints.resolve(tenant, path), snapshot_id=path
        )
        await gw.runtime.publish_sampler(body.model_id, snapshot)
        result: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
        if body.sampling_session_seq_id is not None:
            sampler_id = sampler_id_for(session_id, body.sampling_session_seq_id)
            await gw.samplers.save(
                SamplerRecord(
                    sampling_session_id=sampler_id,
                    tenant=tenant,
                    base_model=model.base_model,
                    created_at=time.time(),
                    session_id=session_id,
                    model_id=body.model_id,
                    model_path=path,
                )
            )
            result["sampling_session_id"] = sampler_id
        return result

    request_id = await _ordered(gw, request, tenant, "SaveWeightsForSampler", body.model_id, body.seq_id, op)
    return future_response(request_id, model_id=body.model_id)


async def _checkpoint_dir(gw: Gateway, tenant: str, tinker_path: str):
    try:
        info = await gw.checkpoints.info(tenant, tinker_path)
        path = await gw.checkpoints.resolve(tenant, tinker_path)
    except CheckpointNotFound as exc:
        raise UserError(f"checkpoint {tinker_path!r} not found (or not yours)") from exc
    if info.kind != "weights":
        raise UserError(f"{tinker_path} is a sampler snapshot; load a tinker://.../weights/... checkpoint")
    return info, path


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> JSONResponse:
    gw = gateway_of(request)
    if body.session_id is not None and body.model_seq_id is not None:
        return await _create_from_state(gw, request, tenant, body)
    if body.model_id is None:
        raise bad_request("load_weights needs model_id, or session_id with model_seq_id")
    await _owned_model(gw, tenant, body.model_id)
    model_id = body.model_id

    async def op() -> dict[str, Any]:
        _, path = await _checkpoint_dir(gw, tenant, body.path)
        await gw.runtime.load_state(model_id, path, body.optimizer)
        return {"path": body.path, "model_id": model_id, "type": "load_weights"}

    request_id = await _ordered(gw, request, tenant, "LoadWeights", model_id, body.seq_id, op)
    return future_response(request_id, model_id=model_id)


async def _create_from_state(
    gw: Gateway, request: Request, tenant: str, body: LoadWeightsBody
) -> JSONResponse:
    await gw.sessions.require_active(tenant, body.session_id)
    model_id = model_id_for(body.session_id, body.model_seq_id)
    try:
        info = await gw.checkpoints.info(tenant, body.path)
    except CheckpointNotFound as exc:
        raise not_found(f"checkpoint {body.path!r}") from exc
    if info.base_model is None:
        raise bad_request(f"checkpoint {body.path} does not record its base model")
    lora = LoraSpec(rank=info.lora_rank) if info.is_lora and info.lora_rank else None

    async def op() -> dict[str, Any]:
        _, path = await _checkpoint_dir(gw, tenant, body.path)
        await gw.runtime.create_model(model_id, info.base_model, lora)
        await gw.runtime.load_state(model_id, path, body.optimizer)
        return {"path": body.path, "model_id": model_id, "type": "load_weights"}

    request_id = await _submit_create(gw, tenant, model_id, info.base_model, lora, None, request, op)
    return future_response(request_id, model_id=model_id)
