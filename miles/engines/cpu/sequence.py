"""One sequence's request (`GenJob`) and progress (`GenState`), and the per-token bookkeeping on them: prompt
and output scoring, stop conditions. Pure: the step scheduler (batching.py) calls these for every row."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.engines.cpu.sampling import SamplingConfig
from miles.engines.cpu.versions import VersionEvent

Ranked = list[tuple[float, int]]
ABORTED: dict[str, Any] = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


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

    @property
    def scores_output(self) -> bool:
        """Whether each sampled position's full distribution is needed (top / chosen-id logprobs)."""
        return self.return_logprob and (self.top_logprobs_num > 0 or self.token_ids_logprob is not None)

    @property
    def scores_prompt(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


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
    # the weight versions that changed while this request ran (versions.py): which version sampled what
    version_events: list[VersionEvent] = field(default_factory=list)

    def upto(self, count: int) -> GenState:
        """The state as it was after its first `count` tokens (unfinished): the scheduler runs ahead of a
        slow streaming reader, which must still see one cumulative chunk per token."""
        return dataclasses.replace(
            self,
            output_ids=self.output_ids[:count],
            output_logprobs=self.output_logprobs[:count],
            output_top=self.output_top[:count],
            output_ids_lp=self.output_ids_lp[:count],
            finish_reason=None,
            text_cut=None,
        )


def _top(logprobs: torch.Tensor, k: int) -> Ranked:
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values, ids, strict=True)]


def _of_ids(logprobs: torch.Tensor, ids: list[int]) -> Ranked:
    return [(float(logprobs[i]), int(i)) for i in ids]


def score_prompt(job: GenJob, state: GenState, logits: torch.Tensor) -> None:
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


def score_output(job: GenJob, state: GenState, next_logits: torch.Tensor | None) -> None:
    if next_logits is None or not job.scores_output:
        return
    logprobs = torch.log_softmax(next_logits.float(), dim=-1)
    if job.top_logprobs_num > 0:
        state.output_top.append(_top(logprobs, job.top_logprobs_num))
    if job.token_ids_logprob is not None:
        state.output_ids_lp.append(_of_ids(logprobs, job.token_ids_logprob))


def check_stop(
    job: GenJob, state: GenState, token: int, eos_ids: Collection[int], decode: Callable[[list[int]], str]
) -> None:
    """Set `state.finish_reason` when `token` (just appended) ends the sequence."""
    cfg = job.cfg
    if len(state.output_ids) < cfg.min_new_tokens:
        return
    if token in cfg.stop_token_ids or (not cfg.ignore_eos and token in eos_ids):
        state.finish_reason = {"type": "stop", "matched": token}
        return
    if cfg.stop:
        text = decode(state.output_ids)
        for stop in cfg.stop:
            at = text.find(stop)
            if at != -1:
                state.finish_reason = {"type": "stop", "matched": stop}
                state.text_cut = None if cfg.no_stop_trim else at
                return
    if len(state.output_ids) >= cfg.max_new_tokens:
        state.finish_reason = {"type": "length", "length": cfg.max_new_tokens}
