"""OpenAI-compatible routes of the CPU engine: /v1/completions and /v1/chat/completions (plain and SSE)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from miles.engines.cpu.engine import Engine
from miles.engines.cpu.generate import GenJob, GenState, build_output, run_job
from miles.engines.cpu.protocol import openai_style_error
from miles.engines.cpu.sampling import make_generator, parse_sampling_params
from miles.engines.cpu.versions import finished_meta


class _Common(BaseModel):
    model: str = "default"
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None
    return_token_ids: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, gt=0)
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    # Unset: the model's generation_config.json, then OpenAI's default (SGLang's chat order).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = None


MODEL_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


def _bad_request(message: str) -> JSONResponse:
    return openai_style_error(400, message, "BadRequestError")


def _sampling(req: _Common, max_tokens: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "sampling_seed": req.seed,
    }
    return {k: v for k, v in params.items() if v is not None}


@functools.cache
def generation_defaults(model_path: str) -> dict[str, Any]:
    """The sampling defaults a model ships in generation_config.json (SGLang's chat falls back to them)."""
    try:
        raw = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: raw[k] for k in MODEL_SAMPLING_DEFAULTS if raw.get(k) is not None}


def _jobs(
    engine: Engine, req: _Common, prompts: list[list[int]], max_tokens: int | None, lp: bool
) -> list[GenJob]:
    model_defaults = generation_defaults(engine.model_path) if isinstance(req, ChatCompletionRequest) else {}
    cfg = parse_sampling_params({**model_defaults, **_sampling(req, max_tokens)})
    if req.lora_path is not None and req.lora_path not in engine.model().adapters:
        raise ValueError(f"LoRA adapter {req.lora_path!r} is not loaded")
    base = req.rid or uuid.uuid4().hex
    jobs = []
    for p, prompt in enumerate(prompts):
        gen = make_generator(cfg.seed, engine.model().device)
        for i in range(req.n):
            rid = base if len(prompts) * req.n == 1 else f"{base}_{p * req.n + i}"
            jobs.append(GenJob(rid, list(prompt), cfg, gen, req.lora_path, return_logprob=lp))
    return jobs


def _finish(state: GenState) -> tuple[str | None, Any]:
    reason = state.finish_reason
    if reason is None:
        return None, None
    kind = reason["type"]
    return ("stop" if kind == "stop" else "length" if kind == "length" else "abort"), reason.get("matched")


async def _final(engine: Engine, job: GenJob) -> GenState:
    last = None
    async for state in run_job(engine, job):
        last = state
    assert last is not None
    return last


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
    if "application/json" not in request.headers.get("content-type", ""):
        return _bad_request("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        return _bad_request(str(exc))


def _usage(jobs: list[GenJob], states: list[GenState]) -> dict[str, int]:
    prompt = sum(len(j.prompt_ids) for j in jobs[:: max(jobs[0].cfg.n, 1)]) if jobs else 0
    completion = sum(len(s.output_ids) for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_prompts(engine: Engine, raw: Any) -> list[list[int]]:
    tok = engine.model().tokenizer
    if isinstance(raw, str):
        return [tok.encode(raw)]
    if raw and isinstance(raw[0], str):
        return [tok.encode(p) for p in raw]
    if raw and isinstance(raw[0], list):
        return [list(p) for p in raw]
    return [list(raw)]


def _completion_choice(
    engine: Engine, req: CompletionRequest, index: int, job: GenJob, state: GenState
) -> dict:
    tok = engine.model().tokenizer
    reason, matched = _finish(state)
    text = build_output(engine, job, state)["text"]
    if req.echo:
        text = tok.decode(job.prompt_ids) + text
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "matched_stop": matched,
    }
    if req.logprobs is not None:
        tokens = [tok.decode([t]) for t in state.output_ids]
        choice["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": state.output_logprobs,
            "top_logprobs": [None] * len(tokens),
            "text_offset": [],
        }
    if req.return_token_ids:
        choice["token_ids"] = state.output_ids
    return choice


def _chat_choice(
    engine: Engine, req: ChatCompletionRequest, index: int, job: GenJob, state: GenState
) -> dict:
    tok = engine.model().tokenizer
    reason, matched = _finish(state)
    logprobs = None
    if req.logprobs:
        content = []
        for token, logprob in zip(state.output_ids, state.output_logprobs, strict=True):
            piece = tok.decode([token])
            content.append(
                {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}
            )
        logprobs = {"content": content}
    return {
        "index": index,
        "message": {"role": "assistant", "content": build_output(engine, job, state)["text"]},
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": matched,
    }


def _envelope(engine: Engine, req: _Common, prefix: str) -> dict[str, Any]:
    model = req.model or engine.served_model_name
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


async def _answer(
    engine: Engine, jobs: list[GenJob], meta: dict[str, Any], obj: str, choice_of: Any
) -> Response:
    states = await asyncio.gather(*(_final(engine, j) for j in jobs))
    choices = [choice_of(i, job, state) for i, (job, state) in enumerate(zip(jobs, states, strict=True))]
    body = {
        **meta,
        "object": obj,
        "choices": choices,
        "usage": _usage(jobs, states),
        # SGLang's build_endpoint_weight_version_metadata, of the first choice
        "metadata": _version_metadata(engine, states[0]),
    }
    return JSONResponse(body)


def _version_metadata(engine: Engine, state: GenState) -> dict[str, Any]:
    spans = finished_meta(state.version_events, engine.weight_version, len(state.output_ids))
    return {"weight_version": spans["weight_version"], "weight_versions": spans["weight_versions"]}


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        assert isinstance(req, CompletionRequest)
        await engine.wait_loaded()
        try:
            prompts = _completion_prompts(engine, req.prompt)
            jobs = _jobs(engine, req, prompts, req.max_tokens, lp=req.logprobs is not None)
        except ValueError as exc:
            return _bad_request(str(exc))
        meta = _envelope(engine, req, "cmpl")
        if req.stream:
            return StreamingResponse(_stream_completions(engine, jobs, meta), media_type="text/event-stream")
        return await _answer(
            engine, jobs, meta, "text_completion", lambda i, j, s: _completion_choice(engine, req, i, j, s)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        if isinstance(req, JSONResponse):
            return req
        assert isinstance(req, ChatCompletionRequest)
        await engine.wait_loaded()
        tok = engine.model().tokenizer
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in req.messages]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        try:
            jobs = _jobs(engine, req, [ids], req.max_completion_tokens or req.max_tokens, lp=req.logprobs)
        except ValueError as exc:
            return _bad_request(str(exc))
        meta = _envelope(engine, req, "chatcmpl")
        if req.stream:
            return StreamingResponse(_stream_chat(engine, jobs, meta), media_type="text/event-stream")
        return await _answer(
            engine, jobs, meta, "chat.completion", lambda i, j, s: _chat_choice(engine, req, i, j, s)
        )


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


async def _deltas(engine: Engine, job: GenJob) -> AsyncIterator[tuple[str, GenState]]:
    """Incremental text per new token (OpenAI streams deltas, unlike /generate's cumulative chunks)."""
    sent_text, sent_len = "", -1
    async for state in run_job(engine, job):
        if len(state.output_ids) == sent_len and state.finish_reason is None:
            continue
        sent_len = len(state.output_ids)
        text = build_output(engine, job, state)["text"]
        delta, sent_text = text[len(sent_text) :], text
        yield delta, state


async def _stream_completions(engine: Engine, jobs: list[GenJob], meta: dict[str, Any]) -> AsyncIterator[str]:
    for index, job in enumerate(jobs):
        async for delta, state in _deltas(engine, job):
            reason, matched = _finish(state)
            choice = {
                "index": index,
                "text": delta,
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            yield f"data: {json.dumps({**meta, 'object': 'text_completion', 'choices': [choice]})}\n\n"
    yield "data: [DONE]\n\n"


async def _stream_chat(engine: Engine, jobs: list[GenJob], meta: dict[str, Any]) -> AsyncIterator[str]:
    for index, job in enumerate(jobs):
        first = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': [first]})}\n\n"
        async for delta, state in _deltas(engine, job):
            reason, matched = _finish(state)
            choice = {
                "index": index,
                "delta": {"content": delta} if delta else {},
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
            yield f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
    yield "data: [DONE]\n\n"
