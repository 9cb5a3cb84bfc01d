"""Tinker sampling routes: sampling sessions, sampler lookup, `asample` (the sampling service samples)."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as tt

from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import bad_request
from miles.gateway.tinker import codec
from miles.gateway.tinker.logprobs import logprob_spec
from miles.gateway.tinker.models import CreateSamplingSessionBody, SampleBody, SamplingParamsBody
from miles.gateway.tinker.responses import future_response, idempotency_key, sdk_json
from miles.types import SamplingParams

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionBody, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    sampler_id = await gateway_of(request).sampling.open_sampler(
        tenant,
        body.session_id,
        body.sampling_session_seq_id,
        base_model=body.base_model,
        model_path=body.model_path,
    )
    return sdk_json(tt.CreateSamplingSessionResponse(sampling_session_id=sampler_id))


@router.get("/samplers/{sampler_id}")
async def get_sampler(
    sampler_id: str, request: Request, tenant: str = Depends(tinker_tenant)
) -> dict[str, Any]:
    rec = await gateway_of(request).sampling.owned_sampler(tenant, sampler_id)
    response = tt.GetSamplerResponse(
        sampler_id=sampler_id, base_model=rec.base_model, model_path=rec.model_path
    )
    return sdk_json(response)


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


@router.post("/asample")
async def asample(body: SampleBody, request: Request, tenant: str = Depends(tinker_tenant)) -> JSONResponse:
    sampling = gateway_of(request).sampling
    prompt = prompt_tokens(body)
    params = sampling_params(body.sampling_params)
    spec, layout = logprob_spec(body, len(prompt), params.max_tokens)
    if body.sampling_session_id:
        target = await sampling.target_of_sampler(tenant, body.sampling_session_id)
    else:
        target = await sampling.resolve_target(tenant, base_model=body.base_model, model_path=body.model_path)
    dedup = None
    if body.sampling_session_id and body.seq_id is not None:
        dedup = (body.sampling_session_id, body.seq_id)
    request_id = await sampling.submit(
        tenant,
        target,
        prompt,
        params,
        num_samples=body.num_samples,
        logprobs=spec,
        dedup=dedup,
        idempotency_key=idempotency_key(request),
        encode=functools.partial(
            codec.encode_sample_output,
            topk_prompt=spec.topk_prompt,
            topk_sample=spec.topk_sample,
            target_layout=layout,
        ),
    )
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    return future_response(request_id, sample_sequence_ids=sequence_ids)
