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
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None


@dataclass
class GenState:
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_scored: bool = False
    # Per position: [(logprob, token id), ...] or None, as SGLang's *_top_logprobs / *_token_ids_logprobs
    input_top: list[Ranked | None] = field(default_factory=list)
    output_top: list[Ranked | None] = field(default_factory=list)
    input_ids_lp: list[Ranked | None] = field(default_factory=list)
    output_ids_lp: list[Ranked | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    text_cut: int | None = None  # where a matched stop string begins in the decoded text
    num_retractions: int = 0


Ranked = list[tuple[float, int]]


def _top(logprobs: torch.Tensor, k: int) -> Ranked:
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values, ids, strict=True)]


def _of_ids(logprobs: torch.Tensor, ids: list[int]) -> Ranked:
    return [(float(logprobs[i]), int(i)) for i in ids]


def _score_prompt(job: GenJob, state: GenState, logits: torch.Tensor) -> None:
    """The prompt's logprobs from `logprob_start_len` on, as SGLang reports them: the entry at the start
    position is always None (SGLang drops the last prefill row and shifts in a None), so position i > start
    carries log p(prompt[i] | prompt[:i])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    positions = range(job.logprob_start_len, len(job.prompt_ids))
    first = job.logprob_start_len
    state.input_logprobs = [
        None if i == first else float(logprobs[i - 1, job.prompt_ids[i]]) for i in positions
    ]
    if job.top_logprobs_num > 0:
        state.input_top = [
            None if i == first else _top(logprobs[i - 1], job.top_logprobs_num) for i in positions
        ]
    if job.token_ids_logprob is not None:
        ids = job.token_ids_logprob
        state.input_ids_lp = [None if i == first else _of_ids(logprobs[i - 1], ids) for i in positions]
    state.input_scored = True


def _score_output(job: GenJob, state: GenState, next_logits: torch.Tensor) -> None:
    if job.top_logprobs_num <= 0 and job.token_ids_logprob is None:
        return
    logprobs = torch.log_softmax(next_logits.float(), dim=-1)
    if job.top_logprobs_num > 0:
        state.output_top.append(_top(logprobs, job.top_logprobs_num))
    if job.token_ids_logprob is not None:
        state.output_ids_lp.append(_of_ids(logprobs, job.token_ids_logprob))


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
            if job.return_logprob and job.logprob_start_len >= 0 and not state.input_scored:
                _score_prompt(job, state, logits)
            next_logits = logits[-1]
        token, logprob = choose_token(next_logits, job.cfg, job.gen)
        if job.return_logprob:
            _score_output(job, state, next_logits)
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
        if job.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _with_text(state.input_top, text_of)
            meta["output_top_logprobs"] = _with_text(state.output_top, text_of)
        if job.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = _with_text(state.input_ids_lp, text_of)
            meta["output_token_ids_logprobs"] = _with_text(state.output_ids_lp, text_of)
    return {"text": text, "output_ids": list(state.output_ids), "meta_info": meta}


def _with_text(rows: list[Ranked | None], text_of: Any) -> list[list[list[Any]] | None]:
    """SGLang's rows: None for an empty position, else [logprob, token id, text|None] per entry."""
    return [None if not row else [[lp, t, text_of(t)] for lp, t in row] for row in rows]
