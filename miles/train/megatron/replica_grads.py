"""The optimizer step of a megatron full fine-tuning trainer on a gradient already summed over every
replica: what a hybrid step needs when some of the batch ran on lanes outside the core's DP group.

The replicas sum each parameter's `main_grad` (megatron's DDP accumulates there, in fp32; the lanes sum
them in place, in chunks, by parameter order, so a core of any DP size and a lane of DP 1 agree whatever
their buffers' padding), then every replica steps without megatron's own DP reduction. Clipping uses a
norm measured once, on the total, by the caller: each replica's own measurement (per shard, or over the
whole) would differ in the last bits and the replicas would drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from miles.train.megatron.optim_state import apply_hyperparams
from miles.types import AdamParams

CLIP_EPS = 1.0e-6  # megatron's: clip_coeff = max_norm / (total_norm + 1e-6)


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
