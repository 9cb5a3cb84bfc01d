"""Tinker's losses as pure torch functions on per-token tensors.

Each loss maps the trainer's per-token logprobs of `target_tokens` (and the datum's other per-token inputs)
to an elementwise loss; the training objective is the plain SUM of elementwise losses over the batch
(Tinker's semantics: no normalisation by token or datum count). Summed losses are what make data parallel
exact: the sum of the ranks' gradients equals the single-rank gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from miles.errors import UserError
from miles.types import SUPPORTED_LOSSES

LossInputs = Mapping[str, torch.Tensor]
LossFunction = Callable[[torch.Tensor, LossInputs, Mapping[str, float]], torch.Tensor]

PPO_DEFAULT_CLIP_LOW = 0.8
PPO_DEFAULT_CLIP_HIGH = 1.2


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-w * logp per token."""
    return -inputs["weights"] * logprobs


def importance_sampling(
    logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]
) -> torch.Tensor:
    """-exp(logp - logp_sampler) * A per token."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-min(r * A, clip(r, low, high) * A) per token, r = exp(logp - logp_sampler)."""
    low = config.get("clip_low_threshold", PPO_DEFAULT_CLIP_LOW)
    high = config.get("clip_high_threshold", PPO_DEFAULT_CLIP_HIGH)
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, low, high) * advantages
    return -torch.minimum(unclipped, clipped)


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs: its function, per-token inputs (besides target_tokens) and allowed config keys."""

    name: str
    fn: LossFunction
    float_inputs: tuple[str, ...]
    config_keys: tuple[str, ...] = ()


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("cross_entropy", cross_entropy, ("weights",)),
    "importance_sampling": LossSpec("importance_sampling", importance_sampling, ("logprobs", "advantages")),
    "ppo": LossSpec("ppo", ppo, ("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
}
assert tuple(LOSSES) == SUPPORTED_LOSSES, "miles.types.SUPPORTED_LOSSES and LOSSES must agree"


def get_loss(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None:
        raise UserError(f"unsupported loss_fn {name!r}; supported losses: {', '.join(SUPPORTED_LOSSES)}")
    return spec


def validate_loss_config(spec: LossSpec, config: Mapping[str, float]) -> dict[str, float]:
    """Check the loss config's keys and values; return it as plain floats."""
    unknown = sorted(set(config) - set(spec.config_keys))
    if unknown:
        allowed = ", ".join(spec.config_keys) or "none"
        raise UserError(f"loss_fn_config keys {unknown} are not used by {spec.name}; allowed keys: {allowed}")
    clean: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        clean[key] = float(value)
    if spec.name == "ppo":
        low = clean.get("clip_low_threshold", PPO_DEFAULT_CLIP_LOW)
        high = clean.get("clip_high_threshold", PPO_DEFAULT_CLIP_HIGH)
        if not 0.0 <= low <= 1.0 <= high:
            raise UserError(
                f"ppo clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {low} and {high}"
            )
    return clean
