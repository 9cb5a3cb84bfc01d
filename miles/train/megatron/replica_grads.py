"""Gradients of a megatron full fine-tuning trainer as one flat fp32 buffer, and the optimizer step that
takes a gradient already summed over every replica: what a hybrid step needs when some of the batch ran
on lanes outside the core's DP group (issue 38).

The flat buffer is in the model's parameter order (`named_parameters`), each parameter's `main_grad`
(megatron's DDP accumulates there, in fp32) flattened, with none of the gradient buffers' padding, so a
core of any DP size and a lane of DP 1 lay it out alike. The core's ranks sum theirs over the core's DP
group, the core's rank 0 adds the lanes' sum, and every replica writes the total back and steps without
megatron's own DP reduction. Clipping uses a norm measured once, on the total, by the caller: each
replica's own measurement (per shard, or over the whole) would differ in the last bits and the replicas
would drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from miles.train.megatron.optim_state import apply_hyperparams
from miles.types import AdamParams

CLIP_EPS = 1.0e-6  # megatron's: clip_coeff = max_norm / (total_norm + 1e-6)


def flat_gradient(named: Sequence[tuple[str, torch.nn.Parameter]]) -> torch.Tensor:
    """Every parameter's accumulated gradient, flattened and concatenated in `named`'s order (fp32)."""
    return torch.cat([param.main_grad.detach().reshape(-1).to(torch.float32) for _, param in named])


def set_flat_gradient(named: Sequence[tuple[str, torch.nn.Parameter]], flat: torch.Tensor) -> None:
    """Write `flat` (flat_gradient's layout) back into the parameters' gradient buffers."""
    total = sum(param.numel() for _, param in named)
    if flat.numel() != total:
        raise ValueError(f"a flat gradient of {flat.numel()} elements for parameters of {total}")
    offset = 0
    with torch.no_grad():
        for _, param in named:
            n = param.numel()
            param.main_grad.copy_(flat[offset : offset + n].view_as(param.main_grad))
            offset += n


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """What the gradient is scaled by before the step (1: no clipping), as megatron computes it."""
    if max_norm <= 0 or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (grad_norm + CLIP_EPS))


def step_summed(
    optimizer, ddp, named: Sequence[tuple[str, torch.nn.Parameter]], adam: AdamParams, grad_norm: float
) -> None:
    """One AdamW step on a gradient the caller already summed over every replica and measured: no DP
    reduction, the clipping of `grad_norm` applied here, megatron's own clipping off."""
    coefficient = clip_coefficient(grad_norm, adam.grad_clip_norm)
    if coefficient < 1.0:
        with torch.no_grad():
            for _, param in named:
                param.main_grad.mul_(coefficient)
    apply_hyperparams(optimizer, adam, clip=False)
    optimizer.step()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
