"""One model step of one adapter group, run on the model thread: drop finished rows from the batch, decode
one token for every running row (one forward), prefill the joining rows (batched among themselves) and
merge them in, and sample every row's next token.

Pure with respect to the sequences: it returns tokens, logprobs and the logits rows the scheduler asked
for, and the scheduler (batching.py) applies them on the event loop, where the requests read their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miles.engines.cpu import graphs, kvbatch, slots
from miles.engines.cpu.kvbatch import KVBatch
from miles.engines.cpu.runner import ModelRunner
from miles.engines.cpu.sampling import SamplingConfig, choose_tokens
from miles.engines.cpu.slots import SlotBatch

Batch = KVBatch | SlotBatch  # the dynamic cache (kvbatch.py) or fixed slots (slots.py): runner.decode_mode


@dataclass(frozen=True)
class RowPlan:
    """What the step needs of one row."""

    cfg: SamplingConfig
    gen: torch.Generator | None  # a seeded request's own generator; None: the step's shared one
    want_logits: bool = False  # return the next-token logits (top / chosen-id logprobs)
    tokens: list[int] = field(default_factory=list)  # decode: [the pending token]; prefill: the sequence
    all_logits: bool = False  # prefill only: logits of every position (prompt logprobs)


@dataclass
class RowResult:
    token: int
    logprob: float
    logits: torch.Tensor | None = None  # [vocab] float32 CPU, when asked
    prompt_logits: torch.Tensor | None = None  # [len(tokens), vocab] float32 CPU, when asked


@dataclass
class GroupPlan:
    adapter: str | None
    kv: Batch | None
    keep: list[int]  # rows of `kv` that go on, in this order: they decode their pending token
    decode: list[RowPlan]  # one per kept row
    prefill: list[RowPlan]  # joining rows: rows without all_logits first (one forward each kind)
    horizon: int = 1  # tokens the rows may still decode at most (fixed slots reserve room for them)


@dataclass
class StepStats:
    forwards: int = 0  # model forwards run (decode and prefill)
    decode_steps: int = 0
    last_batch_size: int = 0  # rows of the latest decode forward
    max_batch_size: int = 0


def run_group_step(
    runner: ModelRunner, plan: GroupPlan, shared: torch.Generator | None, stats: StepStats
) -> tuple[Batch | None, list[RowResult]]:
    """The group's new batch (kept rows, then the joining rows in plan order) and one result per row of
    `plan.decode` + `plan.prefill`."""
    assert [r.all_logits for r in plan.prefill] == sorted(r.all_logits for r in plan.prefill)
    kv = _select(plan.kv, plan.keep)
    results: list[RowResult] = []
    if plan.decode:
        assert kv is not None and kv.rows == len(plan.decode)
        tokens = [row.tokens[0] for row in plan.decode]
        kv, logits = _decode(runner, kv, tokens, plan)
        results += _sample(logits, plan.decode, shared)
        stats.decode_steps += 1
        stats.forwards += 1
        stats.last_batch_size = len(plan.decode)
        stats.max_batch_size = max(stats.max_batch_size, len(plan.decode))
    for all_logits in (False, True):
        rows = [row for row in plan.prefill if row.all_logits == all_logits]
        if rows:
            joined, rows_results = _prefill(runner, plan.adapter, rows, shared)
            kv = _join(runner, kv, joined, plan.horizon)
            results += rows_results
            stats.forwards += 1
    return kv, results


def _select(kv: Batch | None, keep: list[int]) -> Batch | None:
    if kv is None:
        return None
    return slots.select(kv, keep) if isinstance(kv, SlotBatch) else kvbatch.select(kv, keep)


def _decode(runner: ModelRunner, kv: Batch, tokens: list[int], plan: GroupPlan) -> tuple[Batch, torch.Tensor]:
    """The batch after one decode step of every row, and the rows' float logits [rows, vocab]."""
    if isinstance(kv, SlotBatch):
        runner.activate(plan.adapter)
        if not slots.make_room(kv):
            kv = slots.regrow(kv, kv.rows, plan.horizon)
        return kv, graphs.decode(runner, kv, tokens)
    ids, mask, positions = kvbatch.step_inputs(kv, tokens)
    logits, kv.cache = runner.forward_batch(ids, mask, positions, kv.cache, plan.adapter)
    kv.mask, kv.next_pos = mask, kv.next_pos + 1
    return kv, logits[:, -1]


def _join(runner: ModelRunner, kv: Batch | None, joined: KVBatch, horizon: int) -> Batch | None:
    """`kv`'s rows then the freshly prefilled `joined` rows, in the runner's kind of batch."""
    if runner.decode_mode == "dynamic":
        assert not isinstance(kv, SlotBatch)
        return kvbatch.merge(kv, joined)
    if kv is None:
        return slots.from_kv(joined, horizon)
    assert isinstance(kv, SlotBatch)
    return slots.join(kv, joined, horizon)


def _prefill(
    runner: ModelRunner, adapter: str | None, rows: list[RowPlan], shared: torch.Generator | None
) -> tuple[KVBatch, list[RowResult]]:
    seqs = [row.tokens for row in rows]
    ids, mask, positions = kvbatch.left_padded(seqs, runner.device)
    all_logits = rows[0].all_logits
    logits, cache = runner.forward_batch(ids, mask, positions, None, adapter, all_logits=all_logits)
    results = _sample(logits[:, -1], rows, shared)
    if all_logits:
        width = ids.shape[1]
        for result, seq, row_logits in zip(results, seqs, logits, strict=True):
            result.prompt_logits = row_logits[width - len(seq) :].cpu()
    next_pos = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=mask.device)
    return KVBatch(cache, mask, next_pos), results


def _sample(logits: torch.Tensor, rows: list[RowPlan], shared: torch.Generator | None) -> list[RowResult]:
    tokens, logprobs = choose_tokens(logits, [r.cfg for r in rows], [r.gen for r in rows], shared)
    return [
        RowResult(token, logprob, logits[i].cpu() if row.want_logits else None)
        for i, (row, token, logprob) in enumerate(zip(rows, tokens, logprobs, strict=True))
    ]
