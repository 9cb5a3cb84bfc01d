"""Several LoRA tenants' forward_backward requests as one pass over the shared frozen base.

Each tenant's rows go through the base once, together, and through its own adapter only (LoraAdapters.
mixed_batch: every LoRA layer runs all the batch's adapters as one GEMM pair, with a per-row block mask
that keeps each row to its own adapter's columns, lora_layer.py). Each row's loss is its tenant's loss
with its tenant's config, and the pass backpropagates the sum over all tenants: adapters share no
parameters and a row touches only its own adapter, so adapter k's gradient is exactly tenant k's loss
gradient, as if it had run alone. Gradients accumulate per tenant as before (GradientStash over the union).

Per tenant, not per pass:
  - preflight: each request is checked on its own before anything runs; a bad one fails alone;
  - requests that cannot share a pass run alone, in the same command: (N, K) soft targets (a
    micro-batch has one target shape) and a `forward_only` flag other than the first's;
  - the chunked lm_head runs on flattened tokens, where the per-row routing cannot follow: each
    tenant's tokens go through its own adapter's head (LoraAdapters.head_for), chunk by chunk;
  - running out of memory in the shared pass drops the pass (every tenant's gradients as before it) and
    runs each tenant alone, so only a batch that does not fit by itself fails.
Every data-parallel rank takes the same decisions: they depend only on the requests, and an allocation
failure is agreed over all ranks (any_rank_failed) before anyone gathers outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.errors import UserError
from miles.train.backends.compute import (
    DatumResult,
    forward_backward_output,
    micro_batches,
    score_datum,
    target_logprobs,
)
from miles.train.backends.lora import Adapter, LoraAdapters
from miles.train.backends.step_guard import (
    GradientStash,
    any_rank_failed,
    is_out_of_memory,
    release_memory,
)
from miles.train.dist import gather_shares, local_share
from miles.train.preflight import PreflightResult, preflight
from miles.types import Datum, ForwardBackwardOutput

if TYPE_CHECKING:
    from miles.train.backends.transformers_backend import TransformersBackend
    from miles.train.commands import ForwardBackward

Outcome = ForwardBackwardOutput | UserError


@dataclass(frozen=True)
class Tenant:
    """One admitted request: where its outcome goes, what it runs, through which adapter."""

    index: int
    request: ForwardBackward
    checked: PreflightResult
    adapter: Adapter


@dataclass(frozen=True)
class Row:
    datum: Datum
    tenant: Tenant


def forward_backward_many(backend: TransformersBackend, requests: Sequence[ForwardBackward]) -> list[Outcome]:
    """One outcome per request, in order: its output, or the UserError that failed it alone."""
    keys = [request.key for request in requests]
    if len(set(keys)) != len(keys):  # the coalescer sends one request per model: a model's order is its own
        raise ValueError(f"forward_backward_many got one model twice: {keys}")
    outcomes: list[Outcome | None] = [None] * len(requests)
    shared: list[Tenant] = []
    for index, request in enumerate(requests):
        try:
            tenant = admit(backend, index, request)
        except UserError as exc:
            outcomes[index] = exc
            continue
        if not can_share(shared[0] if shared else tenant, tenant):
            outcomes[index] = run_alone(backend, request)
        else:
            shared.append(tenant)
    merged = run_shared(backend, shared) if len(shared) > 1 else None
    for tenant in shared:
        outcomes[tenant.index] = merged[tenant.index] if merged else run_alone(backend, tenant.request)
    assert all(outcome is not None for outcome in outcomes)
    return outcomes  # type: ignore[return-value]


def admit(backend: TransformersBackend, index: int, request: ForwardBackward) -> Tenant:
    """The whole-batch preflight of this request alone (UserError: it fails, the others go on)."""
    lora = backend.lora
    if lora is None:
        raise UserError("forward_backward_many needs a LoRA trainer; this one trains the full model")
    adapter = lora.get(request.key)
    checked = preflight(
        request.data,
        request.loss_fn,
        request.loss_config,
        vocab_size=backend.vocab_size,
        max_context=backend.max_context,
        max_batch_tokens=backend.max_batch_tokens,
    )
    return Tenant(index, request, checked, adapter)


def can_share(first: Tenant, other: Tenant) -> bool:
    """Whether `other` may join a pass led by `first` (see the module docstring for why not)."""
    soft_targets = other.request.data[0].loss_fn_inputs["target_tokens"].ndim != 1
    return not soft_targets and other.request.forward_only == first.request.forward_only


def run_alone(backend: TransformersBackend, request: ForwardBackward) -> Outcome:
    try:
        return request.run(backend)
    except UserError as exc:
        return exc


def run_shared(backend: TransformersBackend, tenants: Sequence[Tenant]) -> dict[int, Outcome] | None:
    """The tenants' rows in one pass; None when some rank ran out of memory or refused a datum (nothing
    of it is kept)."""
    lora = backend.lora
    assert lora is not None
    per_tenant = lora.activate_many([t.adapter for t in tenants])
    backward = not tenants[0].request.forward_only
    stash = GradientStash(p for named in per_tenant for _, p in named) if backward else None
    shares = [local_share(t.request.data, backend.dist) for t in tenants]
    rows = [Row(datum, tenant) for tenant, share in zip(tenants, shares, strict=True) for datum in share]
    try:
        results, out_of_memory = _guarded_rows(backend, lora, rows, backward=backward)
        any_failed = any_rank_failed(out_of_memory, backend.dist, backend.device)
    except BaseException:
        if stash is not None:
            stash.restore()
        raise
    if any_failed:
        results = []
        if stash is not None:
            stash.restore()
        release_memory(backend.device)
        return None
    if stash is not None:
        stash.merge()
    outcomes: dict[int, Outcome] = {}
    start = 0
    for tenant, share in zip(tenants, shares, strict=True):
        mine = gather_shares(results[start : start + len(share)], backend.dist)
        start += len(share)
        outcomes[tenant.index] = forward_backward_output(mine)
    return outcomes


def _guarded_rows(
    backend: TransformersBackend, lora: LoraAdapters, rows: Sequence[Row], *, backward: bool
) -> tuple[list[DatumResult], bool]:
    """run_rows, with an allocation failure or a UserError returned as a flag (the tenants then run one
    by one, where the failure is agreed over the ranks and stays the failing tenant's); leaving the except
    block drops the frames that held the failed pass's activations."""
    try:
        return run_rows(backend, lora, rows, backward=backward), False
    except UserError:
        pass
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
    return [], True


def run_rows(
    backend: TransformersBackend, lora: LoraAdapters, rows: Sequence[Row], *, backward: bool
) -> list[DatumResult]:
    """Per row its result; when `backward`, the summed loss of
    every row is backpropagated, one micro-batch at a time."""
    heads = {row.tenant.adapter.name: lora.head_for(row.tenant.adapter) for row in rows}
    results = []
    start = 0
    for batch in micro_batches([row.datum for row in rows], backend.max_tokens):
        batch_rows = rows[start : start + len(batch)]
        start += len(batch)
        names = [row.tenant.adapter.name for row in batch_rows]
        with torch.set_grad_enabled(backward), lora.mixed_batch(names):
            row_heads = [heads[name] for name in names]
            per_datum = target_logprobs(lora.model, batch, backend.device, backend.logprob_options, row_heads)
        total = per_datum[0].new_zeros(())
        with torch.set_grad_enabled(backward):
            for row, logprobs in zip(batch_rows, per_datum, strict=True):
                loss, config = row.tenant.checked.loss, row.tenant.checked.loss_config
                datum_total, result = score_datum(row.datum, logprobs, loss, config, backend.device)
                total = total + datum_total
                results.append(result)
        if backward:
            total.backward()
    return results
