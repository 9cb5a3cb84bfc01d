"""Logprobs and losses through megatron-core's GPT: right-padded micro-batches, vocab-parallel logprobs.

The output layer is vocab-parallel: each TP rank holds logits for its slice of the vocabulary, and
megatron's `vocab_parallel_cross_entropy` (differentiable, one all-reduce for the max and one for the sum)
gives -logprob of each target without gathering the vocabulary. The losses are the shared ones
(miles.train.losses), applied per datum exactly as the transformers backend does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from miles.train.backends.compute import DatumResult, micro_batches
from miles.train.losses import LossSpec
from miles.types import Datum


def _padded(batch: Sequence[Datum], multiple: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [b, w] and target_tokens [b, w] or [b, w, K], right-padded to a width divisible by
    `multiple` (sequence parallel cuts the sequence over TP ranks)."""
    lengths = [len(d.model_input) for d in batch]
    width = -(-max(lengths) // multiple) * multiple
    target_width = batch[0].loss_fn_inputs["target_tokens"].shape[1:]
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.zeros((len(batch), width, *target_width), dtype=torch.long)
    for row, (datum, length) in enumerate(zip(batch, lengths, strict=True)):
        input_ids[row, :length] = torch.as_tensor(datum.model_input, dtype=torch.long)
        targets[row, :length] = torch.as_tensor(datum.loss_fn_inputs["target_tokens"], dtype=torch.long)
    return input_ids.to(device), targets.to(device)


def target_logprobs(
    model: torch.nn.Module, batch: Sequence[Datum], device: torch.device, pad_multiple: int
) -> list[torch.Tensor]:
    """Per datum, float32 logprobs [N] (or [N, K] for soft targets) of its target_tokens."""
    input_ids, targets = _padded(batch, pad_multiple, device)
    positions = torch.arange(input_ids.shape[1], device=device).unsqueeze(0).expand_as(input_ids)
    logits = model(input_ids, positions, attention_mask=None)  # [b, w, vocab / tp]
    # vocab_parallel_cross_entropy shifts its logits in place: each call gets its own fp32 copy
    if targets.dim() == 2:
        logprobs = -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets)
    else:
        columns = [
            -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets[..., k])
            for k in range(targets.shape[-1])
        ]
        logprobs = torch.stack(columns, dim=-1)
    return [logprobs[row, : len(datum.model_input)] for row, datum in enumerate(batch)]


def datum_loss(
    datum: Datum, logprobs: torch.Tensor, loss: LossSpec, config: dict[str, float], device: torch.device
) -> torch.Tensor:
    names = [*loss.float_inputs, *(n for n in loss.optional_inputs if n in datum.loss_fn_inputs)]
    inputs = {name: torch.as_tensor(datum.loss_fn_inputs[name], device=device).float() for name in names}
    return loss.fn(logprobs, inputs, config)


def run_datums(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss: LossSpec,
    config: dict[str, float],
    *,
    device: torch.device,
    backward: bool,
    max_tokens: int,
    pad_multiple: int,
) -> list[DatumResult]:
    """Forward every datum; when `backward`, gradients of the summed loss accumulate (megatron's DDP hooks
    move them into its gradient buffer)."""
    results: list[DatumResult] = []
    for batch in micro_batches(data, max_tokens):
        with torch.set_grad_enabled(backward):
            per_datum = target_logprobs(model, batch, device, pad_multiple)
            total = per_datum[0].new_zeros(())
            for datum, lp in zip(batch, per_datum, strict=True):
                elementwise = datum_loss(datum, lp, loss, config, device)
                total = total + elementwise.sum()
                results.append(DatumResult(_to_numpy(lp), _to_numpy(elementwise)))
        if backward:
            total.backward()
    return results


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()
