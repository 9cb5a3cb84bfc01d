"""Forward passes over a rank's datums: right-padded micro-batches, per-token logprobs, summed loss.

Right padding with an attention mask leaves every real position's logits as in an unpadded forward (the
mask is causal), so per-datum results do not depend on how datums were grouped into micro-batches.

Logprobs come from the last hidden state in chunks of real (unpadded) tokens: `lm_head` and the fp32
log-softmax run one chunk at a time, optionally under activation checkpointing, so no [tokens, vocab]
fp32 logits tensor ever exists (at vocab 152k and 16k tokens that tensor alone is 10 GB, its gradient
another 10). Models whose logits are not a plain `lm_head(hidden)` use the full-logits path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from miles.train.custom_loss import datum_inputs
from miles.train.losses import LossSpec, sum_metrics
from miles.types import Datum, ForwardBackwardOutput

# Causal LMs whose logits are exactly lm_head(decoder(...).last_hidden_state): no scaling, no softcap.
PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "mistral"})
DEFAULT_CHUNK_TOKENS = 2048


@dataclass
class DatumResult:
    logprobs: np.ndarray  # float32 [N], or [N, K] for (N, K) soft targets
    elementwise_loss: np.ndarray  # float32 [N]
    metrics: dict[str, float] = field(default_factory=dict)  # a custom loss's, for this datum


@dataclass(frozen=True)
class LogprobOptions:
    """How logprobs are computed: tokens per lm_head chunk (0: full logits), checkpointing of a chunk."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    checkpoint_chunks: bool = True


def micro_batches(data: Sequence[Datum], max_tokens: int) -> Iterator[list[Datum]]:
    """Consecutive groups whose padded size (count x longest) stays within max_tokens (at least 1 datum)."""
    group: list[Datum] = []
    longest = 0
    for datum in data:
        length = len(datum.model_input)
        if group and max(longest, length) * (len(group) + 1) > max_tokens:
            yield group
            group, longest = [], 0
        group.append(datum)
        longest = max(longest, length)
    if group:
        yield group


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM inside a peft wrapper (adapters injected), or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def has_plain_head(model: torch.nn.Module) -> bool:
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    return (
        getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
        and getattr(config, "final_logit_softcapping", None) is None
        and isinstance(getattr(lm, "model", None), torch.nn.Module)
        and lm.get_output_embeddings() is not None
    )


def _padded_batch(
    batch: Sequence[Datum], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    lengths = [len(d.model_input) for d in batch]
    width = max(lengths)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    # preflight guarantees one target shape per batch: [N] or [N, K]
    target_width = batch[0].loss_fn_inputs["target_tokens"].shape[1:]
    targets = torch.zeros((len(batch), width, *target_width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (datum, length) in enumerate(zip(batch, lengths, strict=True)):
        input_ids[row, :length] = torch.as_tensor(datum.model_input, dtype=torch.long)
        targets[row, :length] = torch.as_tensor(datum.loss_fn_inputs["target_tokens"], dtype=torch.long)
        mask[row, :length] = 1
    return input_ids.to(device), targets.to(device), mask.to(device), lengths


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logprobs of targets [n] (-> [n]) or of K targets per position [n, K] (-> [n, K])."""
    logits = head(hidden).float()
    per_position = targets.unsqueeze(-1) if targets.dim() == 1 else targets
    picked = logits.gather(-1, per_position) - torch.logsumexp(logits, dim=-1, keepdim=True)
    return picked.squeeze(-1) if targets.dim() == 1 else picked


def _unpad(padded: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """The real positions of right-padded rows, concatenated in row order (no host sync, unlike a mask)."""
    return torch.cat([padded[row, :length] for row, length in enumerate(lengths)])


def target_logprobs(
    model: torch.nn.Module,
    batch: Sequence[Datum],
    device: torch.device,
    options: LogprobOptions = LogprobOptions(),
    row_heads: Sequence[torch.nn.Module] | None = None,
) -> list[torch.Tensor]:
    """Per datum, the float32 logprobs [N] of its target_tokens. `row_heads`: per datum, the module that
    maps its hidden states to logits (several LoRA tenants' lm_heads in one batch); None: the model's own.
    The full-logits path ignores it (the model's own head runs inside its forward)."""
    input_ids, targets, mask, lengths = _padded_batch(batch, device)
    flat_targets = _unpad(targets, lengths)
    if options.chunk_tokens <= 0 or not has_plain_head(model):
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        flat = _chunk_logprobs(torch.nn.Identity(), _unpad(logits, lengths), flat_targets)
        return list(flat.split(lengths))
    lm = causal_lm(model)
    hidden = lm.model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    flat_hidden = _unpad(hidden, lengths)
    heads = row_heads or [lm.get_output_embeddings()] * len(batch)
    use_checkpoint = options.checkpoint_chunks and torch.is_grad_enabled()
    pieces = []
    for head, (first, end) in _head_segments(heads, lengths):
        for start in range(first, end, options.chunk_tokens):  # a chunk never spans two heads
            h = flat_hidden[start : min(start + options.chunk_tokens, end)]
            t = flat_targets[start : min(start + options.chunk_tokens, end)]
            if use_checkpoint:
                pieces.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(head, h, t))
    return list(torch.cat(pieces).split(lengths))


def _head_segments(
    heads: Sequence[torch.nn.Module], lengths: Sequence[int]
) -> Iterator[tuple[torch.nn.Module, tuple[int, int]]]:
    """Runs of consecutive rows with the same head, as [first, end) token ranges of the unpadded batch."""
    first = end = 0
    for row, (head, length) in enumerate(zip(heads, lengths, strict=True)):
        end += length
        if row + 1 == len(heads) or heads[row + 1] is not head:
            yield head, (first, end)
            first = end


def run_datums(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss: LossSpec,
    loss_config: dict[str, float],
    *,
    device: torch.device,
    backward: bool,
    max_tokens: int,
    options: LogprobOptions = LogprobOptions(),
) -> list[DatumResult]:
    """Forward every datum; when `backward`, accumulate gradients of the summed loss into .grad."""
    results: list[DatumResult] = []
    for batch in micro_batches(data, max_tokens):
        with torch.set_grad_enabled(backward):
            per_datum = target_logprobs(model, batch, device, options)
            total = per_datum[0].new_zeros(())
            for datum, lp in zip(batch, per_datum, strict=True):
                datum_total, result = score_datum(datum, lp, loss, loss_config, device)
                total = total + datum_total
                results.append(result)
        if backward:
            total.backward()
    return results


def score_datum(
    datum: Datum, logprobs: torch.Tensor, loss: LossSpec, loss_config: dict[str, float], device: torch.device
) -> tuple[torch.Tensor, DatumResult]:
    """One datum's loss (0-d, what the backward pass sums) and its result. A custom loss gives one number
    per datum: its elementwise loss spreads it evenly over the datum's positions, so that the elementwise
    losses still add up to `loss:sum`."""
    custom = loss.custom
    if custom is None:
        elementwise = datum_loss(datum, logprobs, loss, loss_config, device)
        return elementwise.sum(), DatumResult(to_numpy(logprobs), to_numpy(elementwise))
    out = custom(logprobs, datum_inputs(custom, datum, device))
    positions = logprobs.shape[0]
    spread = (out.loss.detach() / positions).expand(positions)
    metrics = {key: float(value.detach()) for key, value in out.metrics.items()}
    return out.loss, DatumResult(to_numpy(logprobs), to_numpy(spread), metrics)


def forward_backward_output(results: Sequence[DatumResult]) -> ForwardBackwardOutput:
    """The batch's output from its datums' results (in batch order): `loss:sum` and a custom loss's
    metrics, combined as the SDK combines them client-side (`:sum` adds, `:mean` averages over datums)."""
    loss_sum = float(sum(float(r.elementwise_loss.astype("float64").sum()) for r in results))
    return ForwardBackwardOutput(
        logprobs=[r.logprobs for r in results],
        elementwise_loss=[r.elementwise_loss for r in results],
        metrics={"loss:sum": loss_sum, **sum_metrics([(r.metrics, 1) for r in results])},
    )


def datum_loss(
    datum: Datum, logprobs: torch.Tensor, loss: LossSpec, loss_config: dict[str, float], device: torch.device
) -> torch.Tensor:
    """The elementwise loss of one datum from its target logprobs and its float loss inputs."""
    names = [*loss.float_inputs, *(n for n in loss.optional_inputs if n in datum.loss_fn_inputs)]
    inputs = {name: torch.as_tensor(datum.loss_fn_inputs[name], device=device).float() for name in names}
    return loss.fn(logprobs, inputs, loss_config)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()
