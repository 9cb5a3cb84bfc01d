"""Validate a whole forward_backward batch before any rank enters forward.

Every data-parallel rank runs this on the FULL batch (not just its share), so a bad datum anywhere fails on
all ranks at once with the same UserError and no rank is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.errors import UserError
from miles.train.custom_loss import dry_run_problems, extreme_signatures, input_problem, meta_signature
from miles.train.losses import LossSpec, resolve_loss
from miles.types import Datum

MAX_REPORTED_PROBLEMS = 5


@dataclass(frozen=True)
class PreflightResult:
    loss: LossSpec
    loss_config: dict[str, float]


def preflight(
    data: Sequence[Datum],
    loss_fn: str,
    loss_config: Mapping[str, Any],
    *,
    vocab_size: int,
    max_context: int,
    max_batch_tokens: int | None = None,
) -> PreflightResult:
    """Raise UserError naming the first few bad datums and their problems; else return the loss to run.

    `max_batch_tokens`: the per-request token budget (runtime.max_batch_tokens); None = no budget."""
    loss, clean_config = resolve_loss(loss_fn, loss_config or {})
    if len(data) == 0:
        raise UserError("forward_backward got an empty batch; send at least one datum")
    problems: list[str] = []
    for index, datum in enumerate(data):
        problem = datum_problem(datum, loss, vocab_size=vocab_size, max_context=max_context)
        if problem is not None:
            problems.append(f"datum {index}: {problem}")
            if len(problems) == MAX_REPORTED_PROBLEMS:
                break
    if not problems:
        problems.extend(_target_shape_problems(data))
    if not problems and loss.custom is not None:
        signatures = extreme_signatures({meta_signature(datum, loss.custom) for datum in data})
        if problem := dry_run_problems(loss.custom, signatures):
            problems.append(problem)
    if problems:
        raise UserError(f"invalid batch for loss {loss.name}: " + "; ".join(problems))
    if problem := budget_problem(data, max_batch_tokens):
        raise UserError(problem)
    return PreflightResult(loss, clean_config)


def batch_tokens(data: Sequence[Datum]) -> int:
    """The batch's size against the budget: model_input tokens summed over its datums."""
    return sum(len(datum.model_input) for datum in data)


def budget_problem(data: Sequence[Datum], max_batch_tokens: int | None) -> str | None:
    """Why the batch is over the per-request token budget, or None (the datums are already valid)."""
    if max_batch_tokens is None:
        return None
    size = batch_tokens(data)
    if size <= max_batch_tokens:
        return None
    return (
        f"batch of {len(data)} datums has {size} tokens, over this server's per-request budget of "
        f"{max_batch_tokens} tokens (runtime.max_batch_tokens); split it into several forward_backward "
        "calls before one optim_step (gradients accumulate)"
    )


def _target_shape_problems(data: Sequence[Datum]) -> list[str]:
    """One micro-batch holds one target shape: all datums 1-D, or all (N, K) with the same K."""
    widths = {datum.loss_fn_inputs["target_tokens"].shape[1:] for datum in data}
    if len(widths) <= 1:
        return []
    seen = sorted("1-D" if not w else f"K={w[0]}" for w in widths)
    return [f"target_tokens shapes differ across the batch ({', '.join(seen)}); send one K per request"]


def datum_problem(datum: Datum, loss: LossSpec, *, vocab_size: int, max_context: int) -> str | None:
    """The first problem with one datum, or None."""
    tokens = datum.model_input
    problem = _token_array_problem("model_input", tokens, vocab_size)
    if problem:
        return problem
    length = len(tokens)
    if length == 0:
        return "model_input is empty"
    if length > max_context:
        return f"model_input has {length} tokens, more than the model's max context {max_context}"
    inputs = datum.loss_fn_inputs
    required = ("target_tokens", *loss.float_inputs)
    missing = [name for name in required if name not in inputs]
    if missing:
        return f"loss {loss.name} needs loss_fn_inputs {list(required)}; missing {missing}"
    targets = inputs["target_tokens"]
    soft = loss.soft_targets and isinstance(targets, np.ndarray) and targets.ndim == 2
    problem = _token_array_problem("target_tokens", targets, vocab_size, ndim=2 if soft else 1)
    if problem:
        return problem
    present = [*loss.float_inputs, *(name for name in loss.optional_inputs if name in inputs)]
    for name in present:
        # soft targets: weights[i, k] weighs target_tokens[i, k]; every other input stays per position
        ndim = 2 if soft and name == "weights" else 1
        problem = _float_array_problem(name, inputs[name], ndim)
        if problem:
            return problem
    for name in ("target_tokens", *present):
        if len(inputs[name]) != length:
            return (
                f"loss_fn_inputs[{name!r}] has length {len(inputs[name])} but model_input has {length}; "
                "position i of model_input predicts target_tokens[i], so they must align"
            )
    if loss.custom is not None:
        return input_problem(loss.custom, inputs, length, targets.ndim)
    if soft and inputs["weights"].shape != targets.shape:
        return f"weights has shape {list(inputs['weights'].shape)} but target_tokens {list(targets.shape)}"
    mask = inputs.get("sequence_ratio_mask") if "sequence_ratio_mask" in loss.optional_inputs else None
    if mask is not None and not np.any(mask != 0):
        return "sequence_ratio_mask marks no position; mark the sampled tokens the sequence ratio averages"
    return None


def _token_array_problem(name: str, array: object, vocab_size: int, ndim: int = 1) -> str | None:
    if not isinstance(array, np.ndarray) or array.ndim != ndim:
        return f"{name} must be a {ndim}-D integer array"
    if ndim == 2 and array.shape[1] == 0:
        return f"{name} has shape {list(array.shape)}; soft targets need K >= 1 tokens per position"
    if not np.issubdtype(array.dtype, np.integer):
        return f"{name} must hold integer token ids, got dtype {array.dtype}"
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        return f"{name} has token ids outside [0, {vocab_size}) (min {array.min()}, max {array.max()})"
    return None


def _float_array_problem(name: str, array: object, ndim: int = 1) -> str | None:
    if not isinstance(array, np.ndarray) or array.ndim != ndim:
        return f"loss_fn_inputs[{name!r}] must be a {ndim}-D float array"
    if not np.issubdtype(array.dtype, np.floating):
        return f"loss_fn_inputs[{name!r}] must be floating point, got dtype {array.dtype}"
    if not np.all(np.isfinite(array)):
        return f"loss_fn_inputs[{name!r}] contains NaN or infinite values"
    return None
