"""Tinker sampling routes: sampling sessions, sampler lookup, `asample` (the sampling service samples)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker import types as tt

from miles.gateway.context import gateway_of, tinker_tenant
from miles.gateway.errors import bad_request
from miles.gateway.tinker import codec
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
    sampling = gateway_of(request).sampling
    _refuse_unsupported(body)
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
        prompt_tokens(body),
        sampling_params(body.sampling_params),
        num_samples=body.num_samples,
        prompt_logprobs=bool(body.prompt_logprobs),
        dedup=dedup,
        idempotency_key=idempotency_key(request),
        encode=codec.encode_sample_output,
    )
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    return future_response(request_id, sample_sequence_ids=sequence_ids)
