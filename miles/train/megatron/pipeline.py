"""Pipeline parallelism for the megatron backend: one GPT stage per pipeline rank, run by megatron's schedule.

Each pipeline rank builds megatron's GPTModel with `pre_process` (the embedding) on the first stage and
`post_process` (final norm, output layer) on the last, and `num_layers / pipeline` decoder layers, which
megatron names from 0 on every stage (`decoder.layers.0` of stage 1 is the model's layer `num_layers / PP`).
A tied model keeps megatron's arrangement: the last stage holds a copy of the embedding as its output layer,
loaded from the same HF tensor, and megatron all-reduces the two copies' gradients (finalize_model_grads).
Which stage holds what: miles.train.megatron.stages.

A command runs megatron's `get_forward_backward_func` (1F1B) over the request's micro-batches. Every rank
holds every datum, so the data iterator is the same on every stage: the first stage reads the tokens, the
last stage the targets and loss inputs. The last stage's loss function is the chunked vocab-parallel
logprob path (miles.train.megatron.compute) and the shared losses; the per-datum results it keeps are then
broadcast over the pipeline group, so the rank that answers (global rank 0, the first stage) has them.
Micro-batches differ in width and count, so the stages exchange activation shapes (megatron's
`variable_seq_lengths`). LoRA runs through the same schedule on the frozen base (no DDP): each stage's
hooks add the active adapter's deltas (miles.train.megatron.lora), and the last stage's loss function adds
the output layer's (`output_delta`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape
from miles.train.backends.compute import DatumResult, micro_batches, score_datum
from miles.train.losses import LossSpec
from miles.train.megatron import compute, shards
from miles.train.megatron.compute import OutputDelta
from miles.train.megatron.context import ContextSplit
from miles.train.megatron.model import HfCheckpoint, block_spec, transformer_config
from miles.train.megatron.stages import stage_rules
from miles.train.megatron.weights import fuse
from miles.types import Datum

# what the last stage's loss function gives megatron's schedule: the summed loss (backpropagated as is), the
# micro-batch's token count (megatron only adds it up) and the per-datum results (kept in its forward store)
BatchLoss = tuple[torch.Tensor, torch.Tensor, list[DatumResult]]


def _stage() -> tuple[int, int]:
    return (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )


def build_stage_gpt(shape: ModelShape, layout: ParallelLayout, dtype: torch.dtype) -> GPTModel:
    """This rank's stage of the GPT (megatron's parallel state must be initialised with the layout)."""
    pipeline, stage = _stage()
    gpt = GPTModel(
        config=transformer_config(shape, layout, dtype),
        transformer_layer_spec=block_spec(shape.num_layers // pipeline),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=stage == 0,
        post_process=stage == pipeline - 1,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    _mark_stage_tensor_parallel(gpt, shape)
    return gpt


def _mark_stage_tensor_parallel(gpt: GPTModel, shape: ModelShape) -> None:
    """model.mark_tensor_parallel for one stage's tensors (why: see there)."""
    pipeline, stage = _stage()
    params = dict(gpt.named_parameters())
    for rule in stage_rules(shape, pipeline, stage):
        if rule.tp_kind != "replicated":
            dim = 1 if rule.tp_kind == "row" else 0
            set_tensor_model_parallel_attributes(params[rule.mcore_name], is_parallel=True, dim=dim, stride=1)


def load_stage_weights(model: torch.nn.Module, model_dir: str, shape: ModelShape) -> None:
    """Each rank reads only the HF tensors of its stage and keeps its TP shard of each."""
    pipeline, stage = _stage()
    checkpoint = HfCheckpoint(model_dir)
    params = dict(model.named_parameters())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rules = stage_rules(shape, pipeline, stage)
    if set(params) != {rule.mcore_name for rule in rules}:
        raise RuntimeError(f"stage {stage}'s parameters do not match its weight rules: {sorted(params)[:5]}")
    with torch.no_grad():
        for rule in rules:
            full = fuse(rule, {name: checkpoint.tensor(name) for name in rule.hf_names}, shape)
            params[rule.mcore_name].copy_(shards.shard(full, rule.tp_kind, tp, tp_rank))


def _forward_step(
    loss: LossSpec,
    config: dict[str, float],
    device: torch.device,
    pad_multiple: int,
    output_delta: OutputDelta | None,
    split: ContextSplit | None,
    data_iterator: Iterator[list[Datum]],
    model: torch.nn.Module,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], BatchLoss] | None]:
    """megatron's forward_step_func: this stage's forward of the next micro-batch, and on the last stage
    the function that turns its hidden states into the summed loss and the per-datum results."""
    batch = next(data_iterator)
    gpt = getattr(model, "module", model)
    input_ids, _ = compute._padded(batch, pad_multiple, device)
    input_ids, positions = compute.model_inputs(input_ids, split)
    if not gpt.post_process:  # an earlier stage: its hidden states go to the next stage
        return model(input_ids, positions, attention_mask=None), None
    with compute._hidden_states_only(gpt):
        hidden = model(input_ids, positions, attention_mask=None)
    return hidden, partial(_batch_loss, gpt, batch, loss, config, device, pad_multiple, output_delta, split)


def _batch_loss(
    gpt: torch.nn.Module,
    batch: list[Datum],
    loss: LossSpec,
    config: dict[str, float],
    device: torch.device,
    pad_multiple: int,
    output_delta: OutputDelta | None,
    split: ContextSplit | None,
    hidden: torch.Tensor,
) -> BatchLoss:
    """(summed loss, token count, per-datum results) of one micro-batch on the last stage (every CP rank
    of it computes the same, from logprobs gathered over CP)."""
    _, targets = compute._padded(batch, pad_multiple, device)
    per_datum = compute.logprobs_from_hidden(
        gpt, hidden, batch, targets, output_delta=output_delta, split=split
    )
    total = per_datum[0].new_zeros(())
    results = []
    for datum, lp in zip(batch, per_datum, strict=True):
        datum_total, result = score_datum(datum, lp, loss, config, device)
        total = total + datum_total
        results.append(result)
    tokens = torch.tensor(sum(len(d.model_input) for d in batch), dtype=torch.int)
    return total, tokens, results


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
    output_delta: OutputDelta | None = None,
    split: ContextSplit | None = None,
) -> list[DatumResult]:
    """Every datum through the pipeline (1F1B); when `backward`, gradients of the summed loss accumulate in
    megatron's DDP buffers of every stage (LoRA: in the active adapter's parameters). Every rank of the
    pipeline group returns every result."""
    if not data:  # a DP replica with no share: every stage of it skips the schedule alike
        return []
    batches = list(micro_batches(data, max_tokens))
    longest = max(len(d.model_input) for d in data)
    with torch.set_grad_enabled(backward):
        stored = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss, config, device, pad_multiple, output_delta, split),
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=longest,  # megatron's shape hint: the stages exchange each micro-batch's real shape
            micro_batch_size=max(len(b) for b in batches),
            forward_only=not backward,
        )
    pipeline, stage = _stage()
    results = [r for per_batch in stored for r in per_batch] if stage == pipeline - 1 else None
    if pipeline > 1:
        box = [results]
        torch_dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        results = box[0]
    return results
