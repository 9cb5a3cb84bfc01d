"""Out of memory during a forward_backward is that request's user error, not the trainer's death.

A batch that does not fit (activations, logits) fails with an allocation error somewhere in forward or
backward. What the failed call held is freed and the trainable state is left exactly as before the call:
parameters are untouched by forward_backward anyway, and the gradients accumulated by earlier calls of the
same step are set aside for the call (GradientStash) and put back unchanged when it fails. Every data-parallel
rank learns whether any rank failed (`any_rank_failed`) before anyone gathers outputs, so a rank that ran
out of memory never leaves the others waiting in a collective.

A UserError raised on one rank's share (a custom loss's guard at a datum only that rank holds) is agreed
the same way (`agreed_failure`): every rank drops the call and raises that rank's message.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from miles.errors import UserError
from miles.train.dist import DistContext

# Allocation failures torch raises as a plain RuntimeError: the CPU allocator's, and those of CUDA
# libraries that allocate outside torch's caching allocator (a kernel launch, a cuBLAS workspace).
ALLOCATION_FAILURES = (
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure on any device (torch.cuda.OutOfMemoryError is torch.OutOfMemoryError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in ALLOCATION_FAILURES)


class GradientStash:
    """Holds the gradients accumulated before this call aside (references, no copies) while it runs.

    `merge` adds the call's new gradients to them (success); `restore` drops whatever the call produced and
    puts them back as they were (failure). The cost: a call made while gradients are pending (several
    forward_backward calls per optim_step) holds a second gradient buffer until its merge; the first call
    of a step holds none. The sum is old + (this call's micro-batches) rather than one running sum, which
    differs from the old order only in rounding."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._params = list(params)
        self._saved = [param.grad for param in self._params]
        for param in self._params:
            param.grad = None

    def merge(self) -> None:
        for param, saved in zip(self._params, self._saved, strict=True):
            if saved is None:
                continue
            if param.grad is not None:
                saved.add_(param.grad)
            param.grad = saved
        self._saved = []

    def restore(self) -> None:
        for param, saved in zip(self._params, self._saved, strict=True):
            param.grad = saved
        self._saved = []


@dataclass(frozen=True)
class OutOfMemory:
    """What this rank saw when it ran out of memory (a message only: no tensors, no traceback)."""

    message: str


@dataclass(frozen=True)
class Refused:
    """A UserError raised on this rank's share of the batch; every rank raises it (the same message)."""

    message: str


StepFailure = OutOfMemory | Refused


def describe(exc: BaseException) -> OutOfMemory:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return OutOfMemory(first_line[:300])


def any_rank_failed(failed: bool, dist: DistContext | None, device: torch.device) -> bool:
    """True on every rank when any rank failed (one MAX all-reduce of a flag)."""
    if dist is None or dist.world_size == 1:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX, group=dist.group)
    return bool(flag.item())


_NONE, _OUT_OF_MEMORY, _REFUSED = 0, 1, 2


def agreed_failure(
    own: StepFailure | None, dist: DistContext | None, device: torch.device
) -> tuple[bool, StepFailure | None]:
    """(whether any rank failed, what this rank reports), the same decision on every rank. A refusal
    anywhere wins over running out of memory and is gathered, so each rank raises the first refusing
    rank's message; an allocation failure is this rank's own (None: another rank's)."""
    if dist is None or dist.world_size == 1:
        return own is not None, own
    code = _REFUSED if isinstance(own, Refused) else _OUT_OF_MEMORY if own is not None else _NONE
    flag = torch.tensor([code], dtype=torch.int32, device=device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX, group=dist.group)
    worst = int(flag.item())
    if worst != _REFUSED:
        return worst != _NONE, own
    seen: list[StepFailure | None] = [None] * dist.world_size
    torch_dist.all_gather_object(seen, own, group=dist.group)
    return True, next(f for f in seen if isinstance(f, Refused))


def release_memory(device: torch.device) -> None:
    """Return the failed call's blocks: frames already dropped, collect cycles, empty the CUDA cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory_error(
    what: str, own: OutOfMemory | None, num_datums: int, num_tokens: int, budget: int | None
) -> UserError:
    where = f"this rank: {own.message}" if own is not None else "another data-parallel rank"
    limit = (
        f"the per-request budget is {budget} tokens (runtime.max_batch_tokens)"
        if budget is not None
        else "no per-request token budget is set (runtime.max_batch_tokens)"
    )
    return UserError(
        f"{what} ran out of device memory on a batch of {num_datums} datums, {num_tokens} tokens "
        f"({where}); {limit}. Nothing of this call was kept: the model, its accumulated gradients and "
        "the optimizer are as before it. Send fewer or shorter datums per call"
    )
