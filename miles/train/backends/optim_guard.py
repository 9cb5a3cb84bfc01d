"""Out of memory in optim_step is the caller's user error, with parameters, gradients and Adam as before.

"Exactly as before" by copying would cost a second copy of the trainable parameters and of both of Adam's
moments (three times the trainable size) at the moment memory is shortest, on every step. Instead the
step runs in two phases:

1. prepare: everything the step allocates, and nothing that changes existing state: a zero gradient for
   each parameter without one, Adam's moments on the first step (torch would create them lazily inside
   `step()`, after it had started updating), and the data-parallel ranks' flat gradient buffer. Running
   out of memory here drops what was allocated; the gradients, parameters and optimizer are untouched.
   Every rank learns whether any rank failed before the first collective.
2. apply: the all-reduce into that buffer, clipping (in place), and the fused AdamW kernel (in place, on
   CPU and CUDA alike): nothing here allocates anything the size of a parameter, so the step's own sizes
   cannot run it out of memory. An error in this phase stays a server error (state may be half-updated).

The cost of this choice is only that Adam's moments exist from the first step that prepares them rather
than from inside it, which is no extra memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist

from miles.errors import UserError
from miles.train.backends import optim
from miles.train.backends.step_guard import (
    OutOfMemory,
    any_rank_failed,
    describe,
    is_out_of_memory,
    release_memory,
)
from miles.train.dist import DistContext
from miles.types import AdamParams


def new_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """The zero gradient of a parameter no forward_backward reached since the last step."""
    return torch.zeros_like(param)


def new_moment(param: torch.nn.Parameter) -> torch.Tensor:
    """One of Adam's moment buffers for `param`, as torch's AdamW creates it."""
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def new_step_count(param: torch.nn.Parameter, fused: bool) -> torch.Tensor:
    """Adam's step counter as torch creates it: on the parameter's device for the fused kernel."""
    if fused:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=scalar, device="cpu")


def new_flat_buffer(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The ranks' all-reduce buffer: every gradient, flattened and concatenated (a copy)."""
    return torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]


@dataclass
class PreparedStep:
    """What the prepare phase allocated, so that it can be dropped again."""

    optimizer: torch.optim.Optimizer
    new_grads: list[torch.nn.Parameter] = field(default_factory=list)
    new_state: list[torch.nn.Parameter] = field(default_factory=list)
    flat_grads: torch.Tensor | None = None

    def undo(self) -> None:
        for param in self.new_grads:
            param.grad = None
        for param in self.new_state:
            self.optimizer.state.pop(param, None)
        self.new_grads, self.new_state, self.flat_grads = [], [], None


def _allocate(prepared: PreparedStep, params: Sequence[torch.nn.Parameter], dist: DistContext | None) -> None:
    for param in params:
        if param.grad is None:  # no forward_backward since the last step: a zero gradient
            param.grad = new_gradient(param)
            prepared.new_grads.append(param)
    fused = bool(prepared.optimizer.param_groups[0].get("fused"))
    for param in params:
        if len(prepared.optimizer.state.get(param, {})) == 0:
            prepared.new_state.append(param)  # first, so a failure below still drops the partial entry
            prepared.optimizer.state[param] = {
                "step": new_step_count(param, fused),
                "exp_avg": new_moment(param),
                "exp_avg_sq": new_moment(param),
            }
    if dist is not None and dist.world_size > 1 and params:
        prepared.flat_grads = new_flat_buffer(params)


def prepare_step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], dist: DistContext | None
) -> tuple[PreparedStep, OutOfMemory | None]:
    """Phase 1. On an allocation failure everything allocated so far is dropped and the failure returned;
    leaving the except block drops the traceback and with it any frame that held a new buffer."""
    prepared = PreparedStep(optimizer)
    try:
        _allocate(prepared, params, dist)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        prepared.undo()
        if not is_out_of_memory(exc):
            raise
        return prepared, describe(exc)
    return prepared, None


def reduce_gradients(
    prepared: PreparedStep, params: Sequence[torch.nn.Parameter], dist: DistContext | None
) -> None:
    """Phase 2's all-reduce: sum the flat buffer over ranks; each gradient becomes a view of it (no copy)."""
    flat = prepared.flat_grads
    if flat is None or dist is None:
        return
    torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.SUM, group=dist.group)
    offset = 0
    for param in params:
        param.grad = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    prepared.flat_grads = None


def guarded_optim_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    adam: AdamParams,
    dist: DistContext | None,
    device: torch.device,
    *,
    reduce: bool = True,
) -> float:
    """One AdamW step over `params` (gradients summed over ranks, clipped); the gradient norm before
    clipping. Raises the UserError below, with nothing changed, when preparing it runs out of memory.

    `reduce=False`: the gradients are already summed (a hybrid core, docs/elastic.md); the ranks still
    agree on a preparation failure, so none of them steps alone."""
    return float(start_guarded_optim_step(optimizer, params, adam, dist, device, reduce=reduce))


def start_guarded_optim_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    adam: AdamParams,
    dist: DistContext | None,
    device: torch.device,
    *,
    reduce: bool = True,
) -> torch.Tensor:
    """guarded_optim_step with the gradient norm left on the device: the step is queued, and reading the
    norm waits for it (several models' steps queue back to back and wait once)."""
    prepared, failure = prepare_step(optimizer, params, dist if reduce else None)
    if any_rank_failed(failure is not None, dist, device):
        prepared.undo()
        release_memory(device)
        raise optim_step_out_of_memory_error(failure, len(params))
    reduce_gradients(prepared, params, dist)
    optim.apply_hyperparams(optimizer, adam)
    grad_norm = optim.clip_and_measure_later(params, adam.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm  # read once the step is queued: no device idle between the norm and AdamW


def optim_step_out_of_memory_error(own: OutOfMemory | None, num_params: int) -> UserError:
    where = f"this rank: {own.message}" if own is not None else "another data-parallel rank"
    return UserError(
        f"optim_step ran out of device memory while allocating what the step needs for {num_params} "
        f"parameters (Adam's two moments on a first step, or the data-parallel gradient buffer) ({where}). "
        "Nothing was changed: the parameters, the gradients accumulated since the last step and the "
        "optimizer are as before, so the same optim_step can be sent again once the device has room "
        "(another model or adapter on this instance released, or a smaller LoRA rank)"
    )
