"""OpenAI-compatible `/v1/chat/completions`, `/v1/completions` and `/v1/models` (Bearer auth)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles.errors import Category
from miles.gateway.bounds import INT64_MAX, Int64
from miles.gateway.context import Gateway, gateway_of, openai_tenant
from miles.gateway.errors import ApiError, describe_failure
from miles.gateway.openai.chat import chat_prompt, load_tokenizer, text_prompt
from miles.gateway.services.model_ids import parse_model_id
from miles.seam.runtime import ModelCard, SamplerTarget
from miles.types import SampleChunk, SampleOutput, SamplingParams

router = APIRouter(prefix="/v1")
# The hosted service serves the same routes under /oai/api/v1 (its OpenAI-compatible base URL); both here.
HOSTED_PREFIX = "/oai/api"
OPENAI_PREFIXES = ("/v1/", f"{HOSTED_PREFIX}/v1/")
_POLL_S = 0.25


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    # SGLang's and vLLM's extension: run to max_tokens, past the end-of-sequence token
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _eos(self) -> _Body:
        if self.ignore_eos and self.stop:
            raise ValueError("ignore_eos runs to max_tokens and takes no stop strings: drop one of them")
        return self


class ChatBody(_Body):
    messages: list[dict[str, Any]]


class CompletionBody(_Body):
    prompt: str | list[str] | list[Int64]


async def _target(gw: Gateway, tenant: str, model: str) -> SamplerTarget:
    """`model`: a base model id, a tinker:// sampler path, or, as the hosted service takes them,
    `<base model id>;<sampler path>` (the checkpoint on the base it was trained on)."""
    base, sep, path = model.partition(";")
    if sep:
        if not path.startswith("tinker://"):
            raise ApiError(Category.USER, f"model {model!r}: after ';' comes a tinker:// sampler path")
        card, context = _known_base(gw, base)
        target = await gw.sampling.resolve_target(tenant, base_model=None, model_path=path)
        if target.base_model != card.name:
            raise ApiError(
                Category.USER,
                f"model {model!r}: the checkpoint was trained on {target.base_model!r}, not {card.name!r}; "
                f"name its own base model or drop the '{base};' prefix",
            )
        return replace(target, max_context=context)  # the checkpoint at the variant's context
    if model.startswith("tinker://"):
        return await gw.sampling.resolve_target(tenant, base_model=None, model_path=model)
    _known_base(gw, model)
    return await gw.sampling.resolve_target(tenant, base_model=model, model_path=None)


def _known_base(gw: Gateway, model: str) -> tuple[ModelCard, int | None]:
    """The base card and context of a base id or `:peft:` variant; an unknown base is OpenAI's 404."""
    try:
        base = parse_model_id(model).base
    except ValueError as exc:
        raise ApiError(Category.USER, str(exc)) from exc
    if base not in gw.base_models.cards():
        raise ApiError(Category.NOT_FOUND, f"model {model!r} does not exist", kind="model_not_found")
    return gw.base_models.resolve(model)


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
        stop_strings=() if body.ignore_eos else stop,
        stop_token_ids=() if body.ignore_eos else None,
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


def _metadata(out: SampleOutput) -> dict[str, Any]:
    """SGLang's OpenAI `metadata` (of the first choice): the weight version that sampled the answer, and
    per span of its tokens when the weights were updated in place while it ran."""
    spans = out.sequences[0].weight_versions if out.sequences else None
    if not spans:
        return {}
    return {"metadata": {"weight_version": spans[-1]["version"], "weight_versions": spans}}


def _visible(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Each chunk as an SSE event the moment it is made, then [DONE]. A failure after the first event can
    only be reported in-band: an `error` event, then the stream ends. A client that goes away cancels
    the generator, which closes the runtime's stream (aborting the generations)."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except Exception as exc:
            message, category = describe_failure(exc)
            error = {"message": message, "type": category.value, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
            return
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _open_stream(
    gw: Gateway, target: SamplerTarget, prompt: list[int], body: _Body
) -> AsyncGenerator[SampleChunk, None]:
    """The sampling service's stream with its first chunk already here, so that a refusal (limits, a bad
    target, an engine error before any token) is an HTTP error status rather than an in-band event."""
    gw.sampling.check_prompt(target, prompt, _params(body).max_tokens)
    stream = gw.sampling.stream_now(target, prompt, _params(body), body.n)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return _empty()
    except ApiError:
        await stream.aclose()
        raise
    except Exception as exc:
        await stream.aclose()
        message, category = describe_failure(exc)
        raise ApiError(category, message) from exc
    return _prepend(first, stream)


async def _prepend(
    first: SampleChunk, rest: AsyncGenerator[SampleChunk, None]
) -> AsyncGenerator[SampleChunk, None]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _empty() -> AsyncGenerator[SampleChunk, None]:
    return
    yield


@dataclass(frozen=True)
class _Style:
    """What differs between /v1/chat/completions and /v1/completions: names and choice shapes."""

    id_prefix: str
    object: str
    chunk_object: str
    choice: Callable[[int, str, str | None], dict[str, Any]]  # (index, text, finish) -> a whole choice
    chunk_choices: Callable[[int, str, str | None], list[dict[str, Any]]]  # a streamed piece's choices
    first_chunks: Callable[[int], list[dict[str, Any]]]  # choices sent before any token (per n)


_CHAT = _Style(
    id_prefix="chatcmpl",
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    choice=lambda i, text, finish: {
        "index": i,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": None,
    },
    chunk_choices=lambda i, piece, finish: (
        ([{"index": i, "delta": {"content": piece}, "finish_reason": None}] if piece else [])
        + ([{"index": i, "delta": {}, "finish_reason": finish}] if finish is not None else [])
    ),
    first_chunks=lambda n: [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)
    ],
)
_COMPLETION = _Style(
    id_prefix="cmpl",
    object="text_completion",
    chunk_object="text_completion",
    choice=lambda i, text, finish: {"index": i, "text": text, "finish_reason": finish, "logprobs": None},
    chunk_choices=lambda i, piece, finish: (
        [{"index": i, "text": piece, "finish_reason": finish, "logprobs": None}]
        if piece or finish is not None
        else []
    ),
    first_chunks=lambda n: [],
)


@router.post("/chat/completions")
async def chat_completions(
    body: ChatBody, request: Request, tenant: str = Depends(openai_tenant)
) -> Response:
    gw = gateway_of(request)
    target = await _target(gw, tenant, body.model)
    tokenizer = _tokenizer(gw, target.base_model)
    return await _answer(gw, request, target, chat_prompt(tokenizer, body.messages), body, tokenizer, _CHAT)


@router.post("/completions")
async def completions(
    body: CompletionBody, request: Request, tenant: str = Depends(openai_tenant)
) -> Response:
    gw = gateway_of(request)
    target = await _target(gw, tenant, body.model)
    tokenizer = _tokenizer(gw, target.base_model)
    return await _answer(
        gw, request, target, text_prompt(tokenizer, body.prompt), body, tokenizer, _COMPLETION
    )


async def _answer(
    gw: Gateway,
    request: Request,
    target: SamplerTarget,
    prompt: list[int],
    body: _Body,
    tokenizer: Any,
    style: _Style,
) -> Response:
    ident, created = f"{style.id_prefix}-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        stream = await _open_stream(gw, target, prompt, body)
        head = {"id": ident, "object": style.chunk_object, "created": created, "model": body.model}
        return _sse(_chunks(head, body.n, tokenizer, stream, style))
    out = await _sample(gw, request, target, prompt, body)
    if out is None:
        return Response(status_code=499)
    choices = [
        style.choice(i, _visible(tokenizer, seq.tokens), _finish(seq.stop_reason))
        for i, seq in enumerate(out.sequences)
    ]
    answer = {"id": ident, "object": style.object, "created": created, "model": body.model}
    return JSONResponse({**answer, "choices": choices, "usage": _usage(prompt, out), **_metadata(out)})


async def _chunks(
    head: dict[str, Any], n: int, tokenizer: Any, stream: AsyncGenerator[SampleChunk, None], style: _Style
) -> AsyncIterator[dict[str, Any]]:
    for choice in style.first_chunks(n):
        yield {**head, "choices": [choice]}
    async for index, piece, finish in _text_deltas(tokenizer, stream):
        for choice in style.chunk_choices(index, piece, None if finish is None else _finish(finish)):
            yield {**head, "choices": [choice]}


async def _text_deltas(
    tokenizer: Any, stream: AsyncGenerator[SampleChunk, None]
) -> AsyncIterator[tuple[int, str, str | None]]:
    """(choice index, new visible text, stop reason on the choice's last chunk) as tokens arrive. Text is
    held back while it ends in an incomplete character, so the pieces concatenate to the full decode."""
    tokens: dict[int, list[int]] = {}
    emitted: dict[int, str] = {}
    async for chunk in stream:
        ids = tokens.setdefault(chunk.index, [])
        ids.extend(chunk.tokens)
        text, before = _visible(tokenizer, ids), emitted.get(chunk.index, "")
        final = chunk.stop_reason is not None
        piece = ""
        if text.startswith(before) and len(text) > len(before) and (final or not text.endswith("\ufffd")):
            piece = text[len(before) :]
            emitted[chunk.index] = text
        yield chunk.index, piece, chunk.stop_reason


@router.get("/models")
async def list_models(request: Request, tenant: str = Depends(openai_tenant)) -> dict[str, Any]:
    gw = gateway_of(request)
    data = [
        {"id": c.name, "object": "model", "created": 0, "owned_by": "miles"}
        for c in gw.base_models.advertised()
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
