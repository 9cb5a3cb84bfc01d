"""OpenAI-compatible `/v1/chat/completions`, `/v1/completions` and `/v1/models` (Bearer auth)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from miles.errors import Category
from miles.gateway.context import Gateway, gateway_of, openai_tenant
from miles.gateway.errors import ApiError, describe_failure
from miles.gateway.openai.chat import chat_prompt, load_tokenizer, text_prompt
from miles.runtime.api import SamplerTarget
from miles.types import SampleOutput, SamplingParams

router = APIRouter(prefix="/v1")
_POLL_S = 0.25


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class ChatBody(_Body):
    messages: list[dict[str, Any]]


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]


async def _target(gw: Gateway, tenant: str, model: str) -> SamplerTarget:
    if model.startswith("tinker://"):
        return await gw.sampling.resolve_target(tenant, base_model=None, model_path=model)
    if model not in gw.base_models.cards():
        raise ApiError(Category.NOT_FOUND, f"model {model!r} does not exist", kind="model_not_found")
    return await gw.sampling.resolve_target(tenant, base_model=model, model_path=None)


def _tokenizer(gw: Gateway, base_model: str) -> Any:
    card = gw.base_models.cards()[base_model]
    return load_tokenizer(card.tokenizer_path or card.tokenizer_id)


def _params(body: _Body) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else (tuple(body.stop) if body.stop else None)
    return SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or 256,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_strings=stop,
    )


async def _sample(gw: Gateway, request: Request, target: SamplerTarget, prompt: list[int], body: _Body):
    """The sampling service's result within the budget; None if the client went away (the work is
    cancelled). The service applies the sampling limits (max_concurrent_samples, the context length)."""
    work = gw.sampling.sample_now(target, prompt, _params(body), body.n)
    task = asyncio.create_task(work)
    deadline = time.monotonic() + gw.settings.openai_sample_timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(Category.TIMEOUT, "sampling did not finish within MILES_OPENAI_SAMPLE_TIMEOUT")
            done, _ = await asyncio.wait({task}, timeout=min(_POLL_S, remaining))
            if done:
                break
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    try:
        out: SampleOutput = task.result()
    except asyncio.CancelledError as exc:
        raise ApiError(Category.UNAVAILABLE, "the sampling request was cancelled") from exc
    except ApiError:
        raise
    except Exception as exc:
        message, category = describe_failure(exc)
        raise ApiError(category, message) from exc
    return out


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


def _usage(prompt: list[int], out: SampleOutput) -> dict[str, int]:
    completion = sum(len(s.tokens) for s in out.sequences)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }


def _visible(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/chat/completions")
async def chat_completions(
    body: ChatBody, request: Request, tenant: str = Depends(openai_tenant)
) -> Response:
    gw = gateway_of(request)
    target = await _target(gw, tenant, body.model)
    tokenizer = _tokenizer(gw, target.base_model)
    prompt = chat_prompt(tokenizer, body.messages)
    out = await _sample(gw, request, target, prompt, body)
    if out is None:
        return Response(status_code=499)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    texts = [_visible(tokenizer, s.tokens) for s in out.sequences]
    if not body.stream:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "finish_reason": _finish(seq.stop_reason),
                "logprobs": None,
            }
            for i, (seq, text) in enumerate(zip(out.sequences, texts, strict=True))
        ]
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": _usage(prompt, out),
            }
        )
    base = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model}
    chunks: list[dict[str, Any]] = []
    for i, (seq, text) in enumerate(zip(out.sequences, texts, strict=True)):
        chunks.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]})
        for piece in _pieces(tokenizer, seq.tokens, text):
            chunks.append(
                {**base, "choices": [{"index": i, "delta": {"content": piece}, "finish_reason": None}]}
            )
        chunks.append(
            {**base, "choices": [{"index": i, "delta": {}, "finish_reason": _finish(seq.stop_reason)}]}
        )
    return _sse(chunks)


def _pieces(tokenizer: Any, tokens: list[int], full: str) -> list[str]:
    """Per-token text deltas whose concatenation is exactly `full`."""
    pieces, emitted = [], ""
    for n in range(1, len(tokens) + 1):
        text = _visible(tokenizer, tokens[:n])
        if text.startswith(emitted) and len(text) > len(emitted) and not text.endswith("\ufffd"):
            pieces.append(text[len(emitted) :])
            emitted = text
    if full.startswith(emitted) and len(full) > len(emitted):
        pieces.append(full[len(emitted) :])
    return pieces


@router.post("/completions")
async def completions(
    body: CompletionBody, request: Request, tenant: str = Depends(openai_tenant)
) -> Response:
    gw = gateway_of(request)
    target = await _target(gw, tenant, body.model)
    tokenizer = _tokenizer(gw, target.base_model)
    prompt = text_prompt(tokenizer, body.prompt)
    out = await _sample(gw, request, target, prompt, body)
    if out is None:
        return Response(status_code=499)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    texts = [_visible(tokenizer, s.tokens) for s in out.sequences]
    if not body.stream:
        choices = [
            {"index": i, "text": text, "finish_reason": _finish(seq.stop_reason), "logprobs": None}
            for i, (seq, text) in enumerate(zip(out.sequences, texts, strict=True))
        ]
        return JSONResponse(
            {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": choices,
                "usage": _usage(prompt, out),
            }
        )
    base = {"id": ident, "object": "text_completion", "created": created, "model": body.model}
    chunks: list[dict[str, Any]] = []
    for i, (seq, text) in enumerate(zip(out.sequences, texts, strict=True)):
        for piece in _pieces(tokenizer, seq.tokens, text):
            chunks.append(
                {**base, "choices": [{"index": i, "text": piece, "finish_reason": None, "logprobs": None}]}
            )
        chunks.append(
            {
                **base,
                "choices": [
                    {"index": i, "text": "", "finish_reason": _finish(seq.stop_reason), "logprobs": None}
                ],
            }
        )
    return _sse(chunks)


@router.get("/models")
async def list_models(request: Request, tenant: str = Depends(openai_tenant)) -> dict[str, Any]:
    gw = gateway_of(request)
    data = [
        {"id": c.name, "object": "model", "created": 0, "owned_by": "miles"}
        for c in gw.runtime.model_cards()
        if c.sampleable
    ]
    for record in await gw.checkpoints.list(tenant):
        if record.kind == "sampler_weights":
            data.append(
                {
                    "id": record.tinker_path,
                    "object": "model",
                    "created": int(record.created_at),
                    "owned_by": tenant,
                }
            )
    return {"object": "list", "data": data}
