"""Tinker's losses as pure torch functions on per-token tensors.

Each loss maps the trainer's per-token logprobs of `target_tokens` (and the datum's other per-token inputs)
to an elementwise loss; the training objective is the plain SUM of elementwise losses over the batch
(Tinker's semantics: no normalisation by token or datum count). Summed losses are what make data parallel
exact: the sum of the ranks' gradients equals the single-rank gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.contract.custom_loss import CUSTOM_LOSS
from miles.contract.losses import LOSS_NAMES, LossName
from miles.errors import UserError
from miles.train.custom_loss import CustomLoss

LossInputs = Mapping[str, torch.Tensor]
LossFunction = Callable[[torch.Tensor, LossInputs, Mapping[str, float]], torch.Tensor]

PPO_DEFAULT_CLIP_LOW = 0.8
PPO_DEFAULT_CLIP_HIGH = 1.2
# Tinker's documented CISPO defaults: no lower bound on the weight, at most 4.
CISPO_DEFAULT_CLIP_LOW = 0.0
CISPO_DEFAULT_CLIP_HIGH = 4.0
# GSPO's ratio is a per-token geometric mean, far closer to 1 than a token ratio; the GSPO paper's
# epsilons (3e-4 low, 4e-4 high) are the defaults. Tinker does not document its own.
GSPO_DEFAULT_CLIP_LOW = 1.0 - 3e-4
GSPO_DEFAULT_CLIP_HIGH = 1.0 + 4e-4
STABLE_REINFORCE_DEFAULT_KL_COEFF = 0.0


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-w * logp per token; with (N, K) soft targets, -sum_k w[i, k] * logp(target[i, k]) per position."""
    weighted = -inputs["weights"] * logprobs
    return weighted.sum(-1) if weighted.dim() == 2 else weighted


def importance_sampling(
    logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]
) -> torch.Tensor:
    """-exp(logp - logp_sampler) * A per token."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-min(r * A, clip(r, low, high) * A) per token, r = exp(logp - logp_sampler)."""
    low = config.get("clip_low_threshold", PPO_DEFAULT_CLIP_LOW)
    high = config.get("clip_high_threshold", PPO_DEFAULT_CLIP_HIGH)
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return _clipped_surrogate(ratio, inputs["advantages"], low, high)


def cispo(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-sg(clip(r, low, high)) * logp * A per token: the clipped ratio weights the policy gradient."""
    low = config.get("clip_low_threshold", CISPO_DEFAULT_CLIP_LOW)
    high = config.get("clip_high_threshold", CISPO_DEFAULT_CLIP_HIGH)
    weight = torch.clamp(torch.exp(logprobs - inputs["logprobs"]), low, high).detach()
    return -weight * logprobs * inputs["advantages"]


def dro(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-(logp * A - beta/2 * (logp - logp_sampler)^2) per token."""
    penalty = 0.5 * config["beta"] * (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - penalty)


def gspo(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """GSPO-token: every token carries the sequence ratio's value (the geometric mean of the token ratios
    over the positions `sequence_ratio_mask` marks, every position without a mask) and the gradient of its
    own logprob, inside PPO's clipped surrogate."""
    low = config.get("clip_low_threshold", GSPO_DEFAULT_CLIP_LOW)
    high = config.get("clip_high_threshold", GSPO_DEFAULT_CLIP_HIGH)
    token_log_ratio = logprobs.detach() - inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    sequence_log_ratio = token_log_ratio.mean() if mask is None else token_log_ratio[mask != 0].mean()
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, inputs["advantages"], low, high)


def stable_reinforce(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """-r * A + kl_coeff * ((r - 1) - log r) per token, r = exp(logp - logp_sampler): importance-sampled
    REINFORCE plus the k3 estimate of KL(sampler || policy) on the sampled tokens (see docs/training.md)."""
    kl_coeff = config.get("kl_coeff", STABLE_REINFORCE_DEFAULT_KL_COEFF)
    log_ratio = logprobs - inputs["logprobs"]
    ratio = torch.exp(log_ratio)
    return -ratio * inputs["advantages"] + kl_coeff * ((ratio - 1.0) - log_ratio)


@dataclass(frozen=True)
class LossSpec:
    """What a loss needs: its function, per-token inputs (besides target_tokens), allowed config keys,
    the config keys it cannot run without, per-token inputs it uses when given, and whether target_tokens
    may be (N, K) soft targets. `custom`: a stored custom loss, which runs per datum in place of `fn`."""

    name: str
    fn: LossFunction
    float_inputs: tuple[str, ...]
    config_keys: tuple[str, ...] = ()
    required_config: tuple[str, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    soft_targets: bool = False
    custom: CustomLoss | None = None


def _not_elementwise(logprobs: torch.Tensor, inputs: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    raise AssertionError("a custom loss runs per datum (compute.score_datum), not as an elementwise loss")


_RL_INPUTS = ("logprobs", "advantages")
_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[LossName, LossSpec] = {  # one per contract.losses.LOSS_NAMES
    "cross_entropy": LossSpec("cross_entropy", cross_entropy, ("weights",), soft_targets=True),
    "importance_sampling": LossSpec("importance_sampling", importance_sampling, _RL_INPUTS),
    "ppo": LossSpec("ppo", ppo, _RL_INPUTS, _CLIP_KEYS),
    "cispo": LossSpec("cispo", cispo, _RL_INPUTS, _CLIP_KEYS),
    "dro": LossSpec("dro", dro, _RL_INPUTS, ("beta",), required_config=("beta",)),
    "gspo": LossSpec("gspo", gspo, _RL_INPUTS, _CLIP_KEYS, optional_inputs=("sequence_ratio_mask",)),
    "stable_reinforce": LossSpec("stable_reinforce", stable_reinforce, _RL_INPUTS, ("kl_coeff",)),
}

# (low, high) threshold defaults of the losses that clip a ratio.
_CLIP_BOUNDS: dict[str, tuple[float, float]] = {
    "ppo": (PPO_DEFAULT_CLIP_LOW, PPO_DEFAULT_CLIP_HIGH),
    "cispo": (CISPO_DEFAULT_CLIP_LOW, CISPO_DEFAULT_CLIP_HIGH),
    "gspo": (GSPO_DEFAULT_CLIP_LOW, GSPO_DEFAULT_CLIP_HIGH),
}


def get_loss(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None:
        raise UserError(f"unsupported loss_fn {name!r}; supported losses: {', '.join(LOSS_NAMES)}")
    return spec


def resolve_loss(name: str, config: Mapping[str, Any]) -> tuple[LossSpec, dict[str, float]]:
    """The loss a forward_backward names and its checked config; a custom loss comes with its program in
    the config (the gateway puts it there) and runs with no float config."""
    if name == CUSTOM_LOSS:
        custom = CustomLoss.from_config(config)
        spec = LossSpec(
            f"custom loss {custom.name!r}", _not_elementwise, (), soft_targets=True, custom=custom
        )
        return spec, {}
    spec = get_loss(name)
    return spec, validate_loss_config(spec, config)


def sum_metrics(parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """One batch's metrics from its parts' (metrics, datum count): `:mean` keys are averaged by datum count,
    every other key adds up (`loss:sum`, a custom loss's `:sum` metrics)."""
    total = sum(count for _, count in parts)
    out: dict[str, float] = {}
    for metrics, count in parts:
        for key, value in metrics.items():
            weight = count / total if key.endswith(":mean") and total else 1.0
            out[key] = out.get(key, 0.0) + float(value) * weight
    return out


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
    missing = [key for key in spec.required_config if key not in clean]
    if missing:
        raise UserError(
            f"loss {spec.name} needs loss_fn_config keys {missing}; Tinker has no default for them"
        )
    _check_config_values(spec.name, clean)
    return clean


def _check_config_values(name: str, config: Mapping[str, float]) -> None:
    if name in _CLIP_BOUNDS:
        default_low, default_high = _CLIP_BOUNDS[name]
        low = config.get("clip_low_threshold", default_low)
        high = config.get("clip_high_threshold", default_high)
        if not 0.0 <= low <= 1.0 <= high:
            raise UserError(
                f"{name} clip thresholds must satisfy 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {low} and {high}"
            )
    for key in ("beta", "kl_coeff"):
        if key in config and config[key] < 0:
            raise UserError(f"{name}: loss_fn_config[{key!r}] must be >= 0, got {config[key]}")
