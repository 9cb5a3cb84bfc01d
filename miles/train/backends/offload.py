"""A trainer rank's training state off its GPU while colocated engines sample (docs/colocation.md).

Colocated, the trainer and the engines share a GPU. While the engines sample, the trainer needs only its
weights (the next push reads them); its optimizer state (Adam: two tensors per parameter) and any pending
gradients can wait in host memory. `offload` moves what the preset's `colocate.trainer_offload` names to
pinned host memory and returns the freed blocks to the driver (the engine is another process: memory the
trainer's caching allocator keeps is memory the engine cannot have); `reload` puts it back before the next
training command. Both are idempotent, and a CPU trainer has nothing to move.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from miles.train.backends.step_guard import release_memory

OffloadKind = Literal["optimizer", "gradients"]
OFFLOAD_KINDS: frozenset[str] = frozenset({"optimizer", "gradients"})


@dataclass
class OffloadedState:
    """Where each moved tensor came from, to put it back exactly there."""

    device: torch.device
    optimizer: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # (a param's state, key)
    gradients: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.optimizer and not self.gradients


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def offload(
    what: Collection[str],
    optimizers: Iterable[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    device: torch.device,
) -> tuple[OffloadedState, dict[str, int]]:
    """Move `what` ("optimizer", "gradients") of these optimizers and parameters from `device` to pinned
    host memory; (what to put back, bytes moved per kind)."""
    unknown = sorted(set(what) - OFFLOAD_KINDS)
    if unknown:
        raise ValueError(f"cannot offload {unknown}; choose among {sorted(OFFLOAD_KINDS)}")
    state = OffloadedState(device)
    moved = {"optimizer": 0, "gradients": 0}
    if device.type != "cuda":
        return state, moved
    if "optimizer" in what:
        for optimizer in optimizers:
            for per_param in optimizer.state.values():
                for key, value in per_param.items():
                    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                        moved["optimizer"] += _nbytes(value)
                        per_param[key] = _to_host(value)
                        state.optimizer.append((per_param, key))
    if "gradients" in what:
        for param in params:
            if param.grad is not None and param.grad.device.type == "cuda":
                moved["gradients"] += _nbytes(param.grad)
                state.gradients.append((param, _to_host(param.grad)))
                param.grad = None
    torch.cuda.synchronize(device)  # the host copies are complete before the device blocks go
    release_memory(device)
    return state, moved


def reload(state: OffloadedState) -> int:
    """Put back what `offload` moved; the bytes moved."""
    moved = 0
    for per_param, key in state.optimizer:
        per_param[key] = per_param[key].to(state.device, non_blocking=True)
        moved += _nbytes(per_param[key])
    for param, grad in state.gradients:
        param.grad = grad.to(state.device, non_blocking=True)
        moved += _nbytes(grad)
    state.optimizer.clear()
    state.gradients.clear()
    return moved
