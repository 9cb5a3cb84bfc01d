"""Tinker sampling: sampling sessions, sampler lookup and `asample` (a protobuf SampleResponse future)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from miles.checkpoints.paths import CheckpointNotFound
from miles.gateway.context import Gateway, gateway_of, tinker_tenant
from miles.gateway.errors import bad_request, not_found
from miles.gateway.sessions import sampler_id_for
from miles.gateway.tinker import codec
from miles.gateway.tinker.models import CreateSamplingSessionBody, SampleBody, SamplingParamsBody
from miles.gateway.tinker.responses import future_response, idempotency_key
from miles.runtime.api import SamplerTarget
from miles.state.records import DedupClaims, SamplerRecord
from miles.types import SamplingParams

router = APIRouter(prefix="/api/v1")


async def resolve_target(
    gw: Gateway, tenant: str, *, base_model: str | None, model_path: str | None
) -> SamplerTarget:
    """Where to sample: a caller-owned sampler snapshot (404 otherwise) or a sampleable base model."""
    if model_path:
        try:
            info = await gw.checkpoints.info(tenant, model_path)
            path = await gw.checkpoints.resolve(tenant, model_path)
        except CheckpointNotFound as exc:
            raise not_found(f"sampler weights {model_path!r}") from exc
        if info.kind != "sampler_weights":
            raise bad_request(
                f"{model_path} is a training checkpoint; sample from a .../sampler_weights/... path"
            )
        if info.base_model is None:
            raise bad_request(f"{model_path} does not record its base model")
        return SamplerTarget(base_model=info.base_model, snapshot_path=path, snapshot_id=model_path)
    if not base_model:
        raise bad_request("give base_model or model_path")
    card = gw.card(base_model)
    if not card.sampleable:
        raise bad_request(f"base_model {base_model!r} is not served for sampling")
    return SamplerTarget(base_model=base_model)


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    gw = gateway_of(request)
    await gw.sessions.require_active(tenant, body.session_id)
    target = await resolve_target(gw, tenant, base_model=body.base_model, model_path=body.model_path)
    sampler_id = sampler_id_for(body.session_id, body.sampling_session_seq_id)
    record = SamplerRecord(
        sampling_session_id=sampler_id,
        tenant=tenant,
        base_model=target.base_model,
        created_at=time.time(),
        session_id=body.session_id,
        model_path=body.model_path,
    )
    await gw.samplers.save(record)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
async def get_sampler(
    sampler_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    rec = await gateway_of(request).owned_sampler(tenant, sampler_id)
    return {"sampler_id": sampler_id, "base_model": rec.base_model, "model_path": rec.model_path}


def sampling_params(p: SamplingParamsBody) -> SamplingParams:
    stop_strings: tuple[str, ...] | None = None
    stop_tokens: tuple[int, ...] | None = None
    if isinstance(p.stop, str):
        stop_strings = (p.stop,)
    elif isinstance(p.stop, list):
        if not p.stop:
            stop_strings, stop_tokens = (), ()  # [] = never stop early
        elif all(isinstance(s, str) for s in p.stop):
            stop_strings = tuple(p.stop)  # type: ignore[arg-type]
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in p.stop):
            stop_tokens = tuple(p.stop)  # type: ignore[arg-type]
        else:
            raise bad_request(
                "sampling_params.stop must be a string, a list of strings or a list of token ids"
            )
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop_strings=stop_strings,
        stop_token_ids=stop_tokens,
    )


def prompt_tokens(body: SampleBody) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise bad_request(f"prompt.chunks[{i}] is {chunk.type!r}; only encoded_text chunks are supported")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise bad_request("the prompt is empty")
    return tokens


def _refuse_unsupported(body: SampleBody) -> None:
    unsupported = {
        "topk_prompt_logprobs": body.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": body.topk_sample_logprobs > 0,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
        "prompt_logprobs_last_n": body.prompt_logprobs_last_n is not None,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
    }
    asked = [name for name, on in unsupported.items() if on]
    if asked:
        raise bad_request(f"not supported by this server: {', '.join(asked)}; leave them unset")


@router.post("/asample")
async def asample(body: SampleBody, request: Request, tenant: str = Depends(tinker_tenant)) -> JSONResponse:
    gw = gateway_of(request)
    _refuse_unsupported(body)
    if body.sampling_session_id:
        rec = await gw.owned_sampler(tenant, body.sampling_session_id)
        target = await resolve_target(gw, tenant, base_model=rec.base_model, model_path=rec.model_path)
    else:
        target = await resolve_target(gw, tenant, base_model=body.base_model, model_path=body.model_path)
    prompt = prompt_tokens(body)
    card = gw.cards().get(target.base_model)
    if card is not None and len(prompt) >= card.max_context:
        raise bad_request(
            f"prompt has {len(prompt)} tokens; {target.base_model} takes fewer than {card.max_context}"
        )
    params = sampling_params(body.sampling_params)
    want_prompt_logprobs = bool(body.prompt_logprobs)

    async def op() -> bytes:
        out = await gw.runtime.sample(target, prompt, params, body.num_samples, want_prompt_logprobs)
        if len(out.sequences) != body.num_samples:
            raise RuntimeError(
                f"runtime returned {len(out.sequences)} samples for {body.num_samples} requested"
            )
        return codec.encode_sample_output(out)

    dedup = None
    if body.sampling_session_id and body.seq_id is not None:
        dedup = DedupClaims.sample_key(body.sampling_session_id, body.seq_id)
    request_id, _ = await gw.ops.submit_concurrent(
        tenant=tenant,
        kind="Sample",
        model_id=None,
        dedup=dedup,
        idempotency_key=idempotency_key(request),
        operation=op,
    )
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    return future_response(request_id, sample_sequence_ids=sequence_ids)
