"""Forward passes over a rank's datums: right-padded micro-batches, per-token logprobs, summed loss.

Right padding with an attention mask leaves every real position's logits as in an unpadded forward (the
mask is causal), so per-datum results do not depend on how datums were grouped into micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from miles.train.losses import LossSpec
from miles.types import Datum


@dataclass
class DatumResult:
    logprobs: np.ndarray  # float32 [N]
    elementwise_loss: np.ndarray  # float32 [N]


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


def target_logprobs(
    model: torch.nn.Module, batch: Sequence[Datum], device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """[B, T] float32 logprobs of each datum's target_tokens (padded positions are junk) and the lengths."""
    lengths = [len(d.model_input) for d in batch]
    width = max(lengths)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (datum, length) in enumerate(zip(batch, lengths, strict=True)):
        input_ids[row, :length] = torch.tensor(datum.model_input, dtype=torch.long)
        targets[row, :length] = torch.tensor(datum.loss_fn_inputs["target_tokens"], dtype=torch.long)
        mask[row, :length] = 1
    input_ids, targets, mask = input_ids.to(device), targets.to(device), mask.to(device)
    logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, lengths


def run_datums(
    model: torch.nn.Module,
    data: Sequence[Datum],
    loss: LossSpec,
    loss_config: dict[str, float],
    *,
    device: torch.device,
    backward: bool,
    max_tokens: int,
) -> list[DatumResult]:
    """Forward every datum; when `backward`, accumulate gradients of the summed loss into .grad."""
    results: list[DatumResult] = []
    for batch in micro_batches(data, max_tokens):
        with torch.set_grad_enabled(backward):
            logprobs, lengths = target_logprobs(model, batch, device)
            total = logprobs.new_zeros(())
            for row, (datum, length) in enumerate(zip(batch, lengths, strict=True)):
                lp = logprobs[row, :length]
                inputs = {
                    name: torch.tensor(datum.loss_fn_inputs[name], device=device).float()
                    for name in loss.float_inputs
                }
                elementwise = loss.fn(lp, inputs, loss_config)
                total = total + elementwise.sum()
                results.append(DatumResult(_to_numpy(lp), _to_numpy(elementwise)))
        if backward:
            total.backward()
    return results


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy().copy()
