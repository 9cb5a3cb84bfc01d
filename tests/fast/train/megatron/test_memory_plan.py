"""The memory plan counts the parameters a TP rank really holds, and scales as the layout says."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape
from miles.train.megatron import shards
from miles.train.megatron.memory import local_params, plan, table
from miles.train.megatron.weights import hf_to_mcore, tensor_rules


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_params_are_what_rank_zero_holds(tiny_model_dir: Path, tp: int) -> None:
    shape = ModelShape.from_model_dir(tiny_model_dir)
    mcore = hf_to_mcore(load_file(str(tiny_model_dir / "model.safetensors")), shape)
    held = sum(shards.shard(mcore[r.mcore_name], r.tp_kind, tp, 0).numel() for r in tensor_rules(shape))
    assert local_params(shape, tp) == held


def test_the_plan_scales_with_the_layout(tiny_model_dir: Path) -> None:
    shape = ModelShape.from_model_dir(tiny_model_dir)
    one = plan(shape, ParallelLayout(tensor=2, sequence_parallel=True, recompute="full"), data=1, seq=1024)
    five = plan(shape, ParallelLayout(tensor=2, sequence_parallel=True, recompute="full"), data=5, seq=1024)
    assert five.optimizer == one.optimizer // 5 and five.weights == one.weights
    no_sp = plan(shape, ParallelLayout(tensor=2, recompute="full"), data=1, seq=1024)
    assert no_sp.layer_inputs == 2 * one.layer_inputs  # sequence parallel cuts the kept inputs over TP
    kept = plan(shape, ParallelLayout(tensor=2, sequence_parallel=True), data=1, seq=1024)
    assert kept.layer_inputs > one.layer_inputs  # without recompute every layer keeps its working set
    assert "| total |" in table(one)


def test_the_logprobs_keep_one_chunk_of_logits_whatever_the_sequence(tiny_model_dir: Path) -> None:
    shape = ModelShape.from_model_dir(tiny_model_dir)
    layout = ParallelLayout(tensor=2, sequence_parallel=True, recompute="full")
    short, long = plan(shape, layout, 1, seq=4096, chunk=2048), plan(shape, layout, 1, seq=131072, chunk=2048)
    assert long.logits == short.logits == 2048 * (shape.vocab_size // 2) * 10
    assert long.logprob_hidden == 32 * short.logprob_hidden  # the hidden state grows with the sequence
    assert plan(shape, layout, 1, seq=100, chunk=2048).logits == 100 * (shape.vocab_size // 2) * 10


def test_context_parallel_cuts_the_activations_and_the_optimizer_but_not_the_weights(
    tiny_model_dir: Path,
) -> None:
    shape = ModelShape.from_model_dir(tiny_model_dir)
    base = dict(tensor=2, sequence_parallel=True, recompute="full")
    one = plan(shape, ParallelLayout(**base), data=1, seq=8192)
    two = plan(shape, ParallelLayout(context=2, **base), data=1, seq=8192)
    assert (two.weights, two.grads) == (one.weights, one.grads)  # replicated over CP ranks
    assert two.optimizer == one.optimizer // 2  # the distributed optimizer shards over data x context
    assert two.layer_inputs == one.layer_inputs // 2 and two.logprob_hidden == one.logprob_hidden // 2
    assert two.layer_working_set == one.layer_working_set // 2
    # the whole sequence's K and V of one layer (1 KV head per TP rank), bf16, and their gradients
    assert (one.gathered_kv, two.gathered_kv) == (0, 2 * 2 * 8192 * 1 * shape.head_dim * 2)
