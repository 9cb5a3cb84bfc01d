"""Logprobs and losses through megatron-core's GPT: right-padded micro-batches, chunked vocab-parallel
logprobs.

The model runs up to its last hidden state (after the final norm); the output layer and the logprob then
run one chunk of real tokens at a time under activation checkpointing, so the [tokens, vocab / TP] logits
exist for one chunk only, in the forward and again in the backward (at 128K tokens, vocab 152k and TP 8
the unchunked bf16 logits, their fp32 copy and its gradient were 23 GiB per GPU). Each chunk's output layer
is vocab-parallel: each TP rank holds logits for its slice of the vocabulary, and megatron's
`vocab_parallel_cross_entropy` (differentiable, one all-reduce for the max and one for the sum) gives
-logprob of each target without gathering the vocabulary. The losses are the shared ones
(miles.train.losses), applied per datum by the same code as the transformers backend.

Under context parallelism (`split`) the GPT sees the rank's two chunks of each row (input ids and
positions sliced by miles.train.megatron.context); the logprobs of the rank's real tokens are computed as
above and all-gathered over CP into sequence order, so the losses run on whole sequences on every CP rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch.utils.checkpoint import checkpoint

from miles.train.backends.compute import DatumResult, micro_batches, score_datum
from miles.train.losses import LossSpec
from miles.train.megatron.context import ContextSplit, gather_outputs
from miles.train.megatron.memory import LOGPROB_CHUNK_TOKENS
from miles.types import Datum

# what a LoRA adapter adds to the output layer's logits: [n, h] whole-sequence hidden -> [n, vocab / TP]
OutputDelta = Callable[[torch.Tensor], torch.Tensor]
# [2048, vocab / TP] fp32 per chunk: 1.2 GiB at vocab 152k and TP 1 (the memory plan counts the same)
DEFAULT_CHUNK_TOKENS = LOGPROB_CHUNK_TOKENS


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


@contextlib.contextmanager
def _hidden_states_only(gpt: torch.nn.Module) -> Iterator[None]:
    """GPTModel.forward returns the decoder's output (final norm applied) instead of logits: megatron's own
    switch for a model without the output stage, set for one forward."""
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def _full_sequence(hidden: torch.Tensor, gpt: torch.nn.Module) -> torch.Tensor:
    """[b, s, h] from megatron's [s (/ TP under SP), b, h], whole on every TP rank; in the backward the TP
    ranks' partial gradients (each from its vocabulary slice) are summed, as the output layer's own
    column-parallel linear does."""
    if gpt.config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True).transpose(0, 1)
    # contiguous first: megatron's backward all-reduce reduces a contiguous copy of a non-contiguous
    # gradient and returns the unreduced original (found on CPU at TP 2: grad norm 45.5 instead of 59.6)
    return copy_to_tensor_model_parallel_region(hidden.transpose(0, 1).contiguous())


def _output_weight(gpt: torch.nn.Module) -> torch.Tensor:
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _chunk_logprobs(
    weight: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, output_delta: OutputDelta | None = None
) -> torch.Tensor:
    """Logprobs [n] of targets [n], or [n, K] of K targets per position, from hidden [n, h]."""
    logits = F.linear(hidden, weight)  # [n, vocab / TP]
    if output_delta is not None:  # a LoRA adapter on the output layer (miles.train.megatron.lora)
        logits = (logits + output_delta(hidden)).to(logits.dtype)
    # vocab_parallel_cross_entropy shifts its logits in place: each call gets its own fp32 copy
    if targets.dim() == 1:
        return -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets)
    columns = [
        -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets[:, k])
        for k in range(targets.shape[-1])
    ]
    return torch.stack(columns, dim=-1)


def _unpad(padded: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    return torch.cat([padded[row, :length] for row, length in enumerate(lengths)])


def target_logprobs(
    model: torch.nn.Module,
    batch: Sequence[Datum],
    device: torch.device,
    pad_multiple: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    output_delta: OutputDelta | None = None,
    split: ContextSplit | None = None,
) -> list[torch.Tensor]:
    """Per datum, float32 logprobs [N] (or [N, K] for soft targets) of its target_tokens."""
    gpt = getattr(model, "module", model)  # inside megatron's DDP wrapper
    input_ids, targets = _padded(batch, pad_multiple, device)
    input_ids, positions = model_inputs(input_ids, split)
    with _hidden_states_only(gpt):
        hidden = model(input_ids, positions, attention_mask=None)  # [w (/ CP) (/ TP under SP), b, h]
    return logprobs_from_hidden(gpt, hidden, batch, targets, chunk_tokens, output_delta, split)


def model_inputs(input_ids: torch.Tensor, split: ContextSplit | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, positions) [b, w] the GPT takes: under context parallelism the rank's chunks of each."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    if split is None:
        return input_ids, positions
    return split.local(input_ids), split.local(positions)


def logprobs_from_hidden(
    gpt: torch.nn.Module,
    hidden: torch.Tensor,
    batch: Sequence[Datum],
    targets: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    output_delta: OutputDelta | None = None,
    split: ContextSplit | None = None,
) -> list[torch.Tensor]:
    """Per datum logprobs from the decoder's output (final norm applied; also a pipeline's last stage)."""
    lengths = [len(d.model_input) for d in batch]
    whole = _full_sequence(hidden, gpt)  # [b, w (/ CP), h]
    if split is None:
        flat = _chunked_logprobs(
            gpt, _unpad(whole, lengths), _unpad(targets, lengths), chunk_tokens, output_delta
        )
        return list(flat.split(lengths))
    rows, cols = split.real_positions(lengths, targets.shape[1])
    if rows.numel() == 0:
        # every position of this rank is padding (short datums): one padding position keeps its loss
        # connected to its forward, so its backward joins the other ranks' K/V reduce-scatters; that
        # position's logprob is never read (beyond every datum's length)
        rows, cols = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    rows, cols = rows.to(whole.device), cols.to(whole.device)
    local_targets = split.local(targets)
    flat = _chunked_logprobs(gpt, whole[rows, cols], local_targets[rows, cols], chunk_tokens, output_delta)
    local = flat.new_zeros((*local_targets.shape[:2], *flat.shape[1:])).index_put((rows, cols), flat)
    gathered = gather_outputs(local, split)  # [b, w, (K)] in sequence order
    return [gathered[row, :length] for row, length in enumerate(lengths)]


def _chunked_logprobs(
    gpt: torch.nn.Module,
    flat_hidden: torch.Tensor,
    flat_targets: torch.Tensor,
    chunk_tokens: int,
    output_delta: OutputDelta | None,
) -> torch.Tensor:
    """Logprobs [n] (or [n, K]) of flat tokens, one output-layer chunk at a time."""
    weight = _output_weight(gpt)
    use_checkpoint = torch.is_grad_enabled()
    pieces = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        h, t = flat_hidden[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens]
        if use_checkpoint:  # the backward recomputes this chunk's logits instead of keeping them
            pieces.append(checkpoint(_chunk_logprobs, weight, h, t, output_delta, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(weight, h, t, output_delta))
    return torch.cat(pieces)


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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    output_delta: OutputDelta | None = None,
    split: ContextSplit | None = None,
) -> list[DatumResult]:
    """Forward every datum; when `backward`, gradients of the summed loss accumulate (megatron's DDP hooks
    move them into its gradient buffer)."""
    results: list[DatumResult] = []
    for batch in micro_batches(data, max_tokens):
        with torch.set_grad_enabled(backward):
            per_datum = target_logprobs(model, batch, device, pad_multiple, chunk_tokens, output_delta, split)
            total = per_datum[0].new_zeros(())
            for datum, lp in zip(batch, per_datum, strict=True):
                datum_total, result = score_datum(datum, lp, loss, config, device)
                total = total + datum_total
                results.append(result)
        if backward:
            total.backward()
    return results
