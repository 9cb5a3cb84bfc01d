"""Lane state: what must be equal on every lane after every step, its digest, and the copy a joiner gets.

The state of a model key is its trainable parameters and, once it has stepped, AdamW's per-parameter
`exp_avg`, `exp_avg_sq` and `step`. (This backend keeps no separate fp32 master copy: it steps the
parameters in their own dtype, so the parameters are the master weights.) The frozen LoRA base is not part
of it: every lane loads it from the same files and never changes it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from miles.train.backends import optim
from miles.train.hybrid.group import LaneGroup, flatten, unflatten_into

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_entries(backend: Any, key: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in a fixed order: every parameter, then each one's Adam moments and step."""
    named = backend.named_trainable_parameters(key)
    entries = [(name, param.detach()) for name, param in named]
    optimizer = backend.optimizer_of(key)
    if optimizer is None:
        return entries
    for name, param in named:
        slot = optimizer.state.get(param, {})
        for moment in (*MOMENTS, "step"):
            if moment in slot:
                value = slot[moment]
                entries.append(
                    (f"{name}::{moment}", value if torch.is_tensor(value) else torch.tensor(value))
                )
    return entries


def state_digest(entries: list[tuple[str, torch.Tensor]]) -> str:
    """Exact: any differing bit of any tensor, dtype or name changes it."""
    digest = hashlib.sha256()
    for name, tensor in entries:
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


FINGERPRINT_CHUNK = 1 << 22  # elements per chunk: 32 MiB of int64 per temporary
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def state_fingerprint(entries: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Cheap, on the tensors' own device: per tensor, the sum of its elements' bit patterns as integers
    and the same weighted by position mod 251 (so a swap of two elements shows too). Any single changed
    element changes it; unlike `state_digest` it never copies the state to the host."""
    words = []
    for _, tensor in entries:
        flat = tensor.detach().reshape(-1)
        plain = torch.zeros((), dtype=torch.int64, device=flat.device)
        weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, max(flat.numel(), 1), FINGERPRINT_CHUNK):  # bounded int64 temporaries
            bits = (
                flat[start : start + FINGERPRINT_CHUNK]
                .view(_INT_OF_SIZE[flat.element_size()])
                .to(torch.int64)
            )
            weights = (
                torch.arange(start, start + bits.numel(), device=flat.device, dtype=torch.int64) % 251 + 1
            )
            plain += bits.sum()
            weighted += (bits * weights).sum()
        words += [plain, weighted]
    return torch.stack(words).to("cpu") if words else torch.zeros(0, dtype=torch.int64)


def broadcast_state(group: LaneGroup, backend: Any, key: str, root: int = 0) -> None:
    """Every member ends with the root's parameters and optimizer state for `key` (a joiner's first copy)."""
    named = backend.named_trainable_parameters(key)
    params = [param for _, param in named]
    has_optimizer = torch.tensor([int(backend.optimizer_of(key) is not None)], dtype=torch.int64)
    group.broadcast(has_optimizer, root)
    flat = flatten(params)
    group.broadcast(flat, root)
    unflatten_into(flat, params)
    for param in params:
        param.grad = None
    if not has_optimizer.item():
        backend.install_optimizer(key, None)
        return
    optimizer = backend.optimizer_of(key)
    if optimizer is None:
        optimizer = optim.new_adamw(params)
        backend.install_optimizer(key, optimizer)
    moments = {m: _moment_tensors(optimizer, params, m) for m in MOMENTS}
    steps = torch.tensor([_step_of(optimizer, p) for p in params], dtype=torch.float64)
    for tensors in moments.values():
        flat = flatten(tensors)
        group.broadcast(flat, root)
        unflatten_into(flat, tensors)
    group.broadcast(steps, root)
    for param, step in zip(params, steps.tolist(), strict=True):
        slot = optimizer.state[param]
        device = param.device if _step_on_device(optimizer) else torch.device("cpu")
        slot["step"] = torch.tensor(step, dtype=torch.float32, device=device)


def _moment_tensors(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], moment: str) -> list:
    """Each parameter's moment; a lane whose optimizer never saw the parameter gets zeros to overwrite."""
    tensors = []
    for param in params:
        slot = optimizer.state[param]
        if moment not in slot:
            slot[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
        tensors.append(slot[moment])
    return tensors


def _step_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> float:
    step = optimizer.state[param].get("step", 0.0)
    return float(step.item() if torch.is_tensor(step) else step)


def _step_on_device(optimizer: torch.optim.Optimizer) -> bool:
    group = optimizer.param_groups[0]
    return bool(group.get("fused") or group.get("capturable"))
