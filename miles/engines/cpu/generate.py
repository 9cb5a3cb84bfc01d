"""One generation request: admission, then its tokens from the step scheduler (batching.py), and its
SGLang-shaped output."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from miles.engines.cpu.engine import Engine
from miles.engines.cpu.sequence import ABORTED, GenJob, GenState, Ranked
from miles.engines.cpu.versions import finished_meta

__all__ = ["GenJob", "GenState", "build_output", "run_job"]


async def run_job(engine: Engine, job: GenJob) -> AsyncIterator[GenState]:
    """Generate; yields the state after each token (for streaming) and once more when finished."""
    handle = engine.register(job.rid)
    state = GenState()
    handle.state = state
    try:
        await engine.admit(handle)
        if job.cfg.max_new_tokens == 0:
            state.finish_reason = {"type": "length", "length": 0}
        elif handle.aborted:
            state.finish_reason = dict(ABORTED)
        else:
            async for view in engine.scheduler.generate(job, handle, state):
                yield view
    finally:
        state.num_retractions = handle.num_retractions
        await engine.finish(handle)
    yield state


def build_output(engine: Engine, job: GenJob, state: GenState) -> dict[str, Any]:
    """The /generate response dict of one sequence (also a streaming chunk: fields are cumulative)."""
    tok = engine.model().tokenizer
    text = tok.decode(state.output_ids, skip_special_tokens=job.cfg.skip_special_tokens)
    if state.text_cut is not None:
        text = text[: state.text_cut]
    done = state.finish_reason is not None
    meta: dict[str, Any] = {
        "id": job.rid,
        "finish_reason": state.finish_reason,
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": len(state.output_ids),
        "cached_tokens": 0,
        "weight_version": engine.weight_version,
        "num_retractions": state.num_retractions,
        **(finished_meta(state.version_events, engine.weight_version, len(state.output_ids)) if done else {}),
        "e2e_latency": time.monotonic() - state.started,
    }
    if job.return_logprob:
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
