"""One generation request: admission, token loop with pause/abort handling, SGLang-shaped output."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.engines.cpu.engine import Engine
from miles.engines.cpu.requests import RequestHandle
from miles.engines.cpu.sampling import SamplingConfig, choose_token


@dataclass
class GenJob:
    """What one sequence needs; `gen` is shared by the n samples of a request (distinct, reproducible)."""

    rid: str
    prompt_ids: list[int]
    cfg: SamplingConfig
    gen: torch.Generator
    adapter: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False


@dataclass
class GenState:
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    text_cut: int | None = None  # where a matched stop string begins in the decoded text
    num_retractions: int = 0


def _input_logprobs(logits: torch.Tensor, prompt: list[int], start: int) -> list[float | None]:
    """Logprob of each prompt token from position `start` given its prefix; the first token has none."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out: list[float | None] = []
    for i in range(max(start, 0), len(prompt)):
        out.append(None if i == 0 else float(logprobs[i - 1, prompt[i]]))
    return out


def _check_stop(engine: Engine, job: GenJob, state: GenState, token: int) -> None:
    cfg = job.cfg
    if len(state.output_ids) < cfg.min_new_tokens:
        return
    if token in cfg.stop_token_ids or (not cfg.ignore_eos and token in engine.model().eos_token_ids):
        state.finish_reason = {"type": "stop", "matched": token}
        return
    if cfg.stop:
        text = _decode(engine, job, state.output_ids)
        for stop in cfg.stop:
            at = text.find(stop)
            if at != -1:
                state.finish_reason = {"type": "stop", "matched": stop}
                state.text_cut = None if cfg.no_stop_trim else at
                return
    if len(state.output_ids) >= cfg.max_new_tokens:
        state.finish_reason = {"type": "length", "length": cfg.max_new_tokens}


def _decode(engine: Engine, job: GenJob, ids: list[int]) -> str:
    return engine.model().tokenizer.decode(ids, skip_special_tokens=job.cfg.skip_special_tokens)


async def run_job(engine: Engine, job: GenJob) -> AsyncIterator[GenState]:
    """Generate; yields the state after each token (for streaming) and once more when finished."""
    handle = engine.register(job.rid)
    state = GenState()
    try:
        await engine.admit(handle)
        async for _ in _token_loop(engine, job, handle, state):
            yield state
    finally:
        state.num_retractions = handle.num_retractions
        await engine.finish(handle)
    yield state


async def _token_loop(
    engine: Engine, job: GenJob, handle: RequestHandle, state: GenState
) -> AsyncIterator[None]:
    past: Any = None
    if job.cfg.max_new_tokens == 0:
        state.finish_reason = {"type": "length", "length": 0}
    while state.finish_reason is None:
        if handle.aborted:
            state.finish_reason = {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            return
        if engine.must_park(handle) and await engine.park(handle):
            past = None  # retracted: the KV cache is recomputed from prompt + output so far
            continue
        if past is None:
            logits, past = await engine.run_model(job.prompt_ids + state.output_ids, None, job.adapter)
            if job.return_logprob and job.logprob_start_len >= 0 and not state.input_logprobs:
                state.input_logprobs = _input_logprobs(logits, job.prompt_ids, job.logprob_start_len)
            next_logits = logits[-1]
        token, logprob = choose_token(next_logits, job.cfg, job.gen)
        state.output_ids.append(token)
        state.output_logprobs.append(logprob)
        _check_stop(engine, job, state, token)
        yield None
        if state.finish_reason is None:
            logits, past = await engine.run_model([token], past, job.adapter)
            next_logits = logits[-1]


def build_output(engine: Engine, job: GenJob, state: GenState) -> dict[str, Any]:
    """The /generate response dict of one sequence (also a streaming chunk: fields are cumulative)."""
    text = _decode(engine, job, state.output_ids)
    if state.text_cut is not None:
        text = text[: state.text_cut]
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": state.finish_reason,
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        "weight_version": engine.weight_version,
        "num_retractions": state.num_retractions,
        "e2e_latency": time.monotonic() - state.started,
    }
    if job.return_logprob:
        tok = engine.model().tokenizer
        text_of = (lambda t: tok.decode([t])) if job.return_text_in_logprobs else (lambda t: None)
        meta["output_token_logprobs"] = [
            [lp, t, text_of(t)] for lp, t in zip(state.output_logprobs, state.output_ids, strict=True)
        ]
        start = max(job.logprob_start_len, 0)
        meta["input_token_logprobs"] = [
            [lp, t, text_of(t)] for lp, t in zip(state.input_logprobs, job.prompt_ids[start:], strict=False)
        ]
        meta["output_token_logprobs_length"] = len(state.output_ids)
    return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}
