"""AdamW per trainable model: Tinker's per-step hyperparameters, clipping, pickle-free optimizer state.

Optimizer state is saved as safetensors (`<param name>::<state key>`) plus the step's hyperparameters in
JSON, so a checkpoint never needs unpickling to resume.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles.errors import UserError
from miles.types import AdamParams

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"


def validate_adam(adam: AdamParams) -> None:
    checks = {
        "learning_rate must be >= 0": adam.learning_rate >= 0,
        "beta1 must be in [0, 1)": 0 <= adam.beta1 < 1,
        "beta2 must be in [0, 1)": 0 <= adam.beta2 < 1,
        "eps must be > 0": adam.eps > 0,
        "weight_decay must be >= 0": adam.weight_decay >= 0,
        "grad_clip_norm must be >= 0 (0 = off)": adam.grad_clip_norm >= 0,
    }
    bad = [msg for msg, ok in checks.items() if not ok]
    values = (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm)
    if not all(math.isfinite(v) for v in values):
        bad.append("all adam_params must be finite numbers")
    if bad:
        raise UserError(f"invalid adam_params {adam}: " + "; ".join(bad))


def new_adamw(params: Sequence[torch.nn.Parameter], adam: AdamParams | None = None) -> torch.optim.AdamW:
    adam = adam or AdamParams()
    params = list(params)
    # The fused kernel on CUDA and CPU: one launch for all tensors (the foreach default launches several per
    # step), and it updates in place with no temporary the size of a parameter, so a step whose state was
    # allocated beforehand cannot run out of memory half way (optim_guard). The per-tensor CPU default
    # allocates one (the denominator) after it has updated that parameter's moments.
    fused = bool(params) and all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params,
        fused=fused or None,
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )


def step_metrics(grad_norm: torch.Tensor | float, adam: AdamParams) -> dict[str, float]:
    """An optim_step's answer: the gradient norm before clipping (reading a tensor waits for the device)."""
    return {"grad_norm:mean": float(grad_norm), "learning_rate:mean": adam.learning_rate}


def apply_hyperparams(optimizer: torch.optim.Optimizer, adam: AdamParams) -> None:
    """Tinker sends the hyperparameters with every step (schedules live on the client)."""
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay


def clip_and_measure(params: Sequence[torch.nn.Parameter], grad_clip_norm: float) -> float:
    """Total gradient L2 norm before clipping; clips in place when grad_clip_norm > 0."""
    return float(clip_and_measure_later(params, grad_clip_norm))


def clip_and_measure_later(params: Sequence[torch.nn.Parameter], grad_clip_norm: float) -> torch.Tensor:
    """clip_and_measure's norm as a 0-d tensor on the gradients' device: reading it waits for the device,
    so a caller reads it once the step's kernels are queued. The same ops as torch's clip_grad_norm_
    (foreach norms, one norm of them, one clamped scale), except that without clipping it skips the
    multiply by 1.0, which changes nothing."""
    params = list(params)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if grad_clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip_norm, norm)
    return norm


def save_optimizer(
    optimizer: torch.optim.Optimizer, names: Sequence[str], params: Sequence[torch.nn.Parameter], path: Path
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name, param in zip(names, params, strict=True):
        for key, value in optimizer.state.get(param, {}).items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{name}::{key}"] = tensor.detach().to("cpu").contiguous()
    save_file(tensors, str(path / OPTIMIZER_TENSORS))
    group = optimizer.param_groups[0]
    meta = {
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "wd": group["weight_decay"],
    }
    (path / OPTIMIZER_META).write_text(json.dumps(meta) + "\n")


def load_optimizer(
    optimizer: torch.optim.Optimizer, names: Sequence[str], params: Sequence[torch.nn.Parameter], path: Path
) -> None:
    tensors_path = path / OPTIMIZER_TENSORS
    if not tensors_path.is_file():
        raise UserError(f"checkpoint {path} has no optimizer state; load it without the optimizer")
    tensors = load_file(str(tensors_path))
    meta = json.loads((path / OPTIMIZER_META).read_text())
    state_dict = optimizer.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, (name, param) in enumerate(zip(names, params, strict=True)):
        entries = {k.split("::", 1)[1]: v for k, v in tensors.items() if k.split("::", 1)[0] == name}
        if entries:
            state[index] = {
                k: (v if k == "step" else v.to(device=param.device, dtype=param.dtype))
                for k, v in entries.items()
            }
    state_dict["state"] = state
    for group in state_dict["param_groups"]:
        group.update(lr=meta["lr"], betas=tuple(meta["betas"]), eps=meta["eps"], weight_decay=meta["wd"])
    optimizer.load_state_dict(state_dict)
