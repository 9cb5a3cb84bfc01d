"""LoRA adapters in PEFT names <-> megatron's fused layers and their TP shards, on the tiny model (CPU, pure
torch: no megatron-core needed, so CI runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.contract.shape import ModelShape
from miles.train.megatron import lora_weights as lw
from miles.train.megatron import shards
from miles.train.megatron.weights import TensorRule, fuse
from miles.types import LoraSpec

SPEC = LoraSpec(rank=3)  # attention, MLP and unembedding, as Tinker's default
TP_SIZES = (1, 2, 4)  # the tiny model has 2 KV heads: TP 4 cuts inside a KV group


@pytest.fixture(scope="module")
def shape(tiny_model_dir: Path) -> ModelShape:
    return ModelShape.from_model_dir(tiny_model_dir)


def random_adapter(shape: ModelShape, spec: LoraSpec, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(size, generator=generator, dtype=dtype)
        for rule in lw.lora_rules(shape, spec)
        for name, size in lw.hf_shapes(rule, shape, spec.rank).items()
    }


def test_the_mapping_names_exactly_the_tensors_peft_saves(tiny_model_dir: Path, shape: ModelShape) -> None:
    from transformers import AutoModelForCausalLM

    from miles.train.backends.lora import LoraAdapters

    adapters = LoraAdapters(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(tiny_model_dir))
    for spec in (SPEC, LoraSpec(rank=2, train_attn=False, train_unembed=False)):
        key = f"r{spec.rank}"
        peft = {n: tuple(t.shape) for n, t in adapters.state_dict(adapters.create(key, spec)).items()}
        mine = {
            n: s
            for rule in lw.lora_rules(shape, spec)
            for n, s in lw.hf_shapes(rule, shape, spec.rank).items()
        }
        assert mine == peft


def test_peft_to_megatron_and_back_is_exact_at_every_tp_size(shape: ModelShape) -> None:
    rules = lw.lora_rules(shape, SPEC)
    assert [r.module.rsplit(".", 1)[-1] for r in rules[:4]] == [
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    ]
    hf = random_adapter(shape, SPEC)
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    for tp in TP_SIZES:
        per_rank = [lw.hf_to_local(rules, hf, shape, tp, rank) for rank in range(tp)]
        local = per_rank[0]
        qkv, fc1, proj = (
            f"decoder.layers.0.{m}"
            for m in ("self_attention.linear_qkv", "mlp.linear_fc1", "self_attention.linear_proj")
        )
        assert local[f"{qkv}.lora_A.weight"].shape == (
            3 * SPEC.rank,
            shape.hidden_size,
        )  # q, k, v: each its A
        assert local[f"{qkv}.lora_B.weight"].shape == (qkv_rows // tp, SPEC.rank)  # column: B by output rows
        assert local[f"{fc1}.lora_B.weight"].shape == (2 * shape.ffn_hidden_size // tp, SPEC.rank)
        assert local[f"{proj}.lora_A.weight"].shape == (
            SPEC.rank,
            shape.num_heads * shape.head_dim // tp,
        )  # row
        assert local[f"{proj}.lora_B.weight"].shape == (shape.hidden_size, SPEC.rank)
        back = lw.merge_to_hf(rules, per_rank, shape)
        assert back.keys() == hf.keys()
        assert all(torch.equal(back[name], hf[name]) for name in hf), tp


def test_each_ranks_lora_delta_is_exactly_its_shard_of_the_peft_delta(shape: ModelShape) -> None:
    """What the forward computes on a rank (x A^T, each row through its own part's A, then the rank's B rows;
    row-parallel: the rank's input columns) is the rank's shard of the HF modules' B @ A, fused."""
    rules = lw.lora_rules(shape, SPEC)
    hf = random_adapter(shape, SPEC, torch.float64)
    for tp in TP_SIZES:
        for rank in range(tp):
            local = lw.hf_to_local(rules, hf, shape, tp, rank)
            for rule in rules:
                a, b = local[rule.a_name], local[rule.b_name]
                rows, inverse = lw.part_rows(lw.part_ids(rule, shape, tp, rank), len(rule.hf_modules))
                got = lw.apply_b(a.t(), b, rows, inverse).t()  # [out rows of this rank, in]
                deltas = {}
                for module in rule.hf_modules:
                    a_name, b_name = lw.peft_names(module)
                    deltas[f"{module}.weight"] = hf[b_name] @ hf[a_name]
                full = fuse(
                    TensorRule(rule.module, tuple(deltas), rule.fusion, rule.base_kind), deltas, shape
                )
                want = shards.shard(full, rule.base_kind, tp, rank)
                torch.testing.assert_close(
                    got, want, rtol=0, atol=1e-12, msg=f"{rule.module} tp {tp} rank {rank}"
                )


def test_adapter_tensors_that_do_not_fit_the_layers_are_named(shape: ModelShape) -> None:
    hf = random_adapter(shape, SPEC)
    hf.pop(next(iter(hf)))
    with pytest.raises(ValueError, match=r"missing \['base_model\.model\.model\.layers\.0"):
        lw.hf_to_local(lw.lora_rules(shape, SPEC), hf, shape, 1, 0)


def test_pipeline_stages_split_the_adapter_layers_and_name_them_as_their_gpt_does(shape: ModelShape) -> None:
    """The tiny model's 2 layers at pipeline 2: one each, named from 0 on each stage, the output layer's LoRA
    on the last; together the stages hold exactly the whole model's PEFT tensors, in its order."""
    pipeline = 2
    whole = lw.lora_rules(shape, SPEC)
    stages = [lw.lora_rules(shape, SPEC, pipeline, stage) for stage in range(pipeline)]
    assert [n for rules in stages for n in lw.hf_names(rules, shape)] == lw.hf_names(whole, shape)
    per_stage = shape.num_layers // pipeline
    for stage, rules in enumerate(stages):
        decoder = [r for r in rules if r.module != lw.UNEMBED_LAYER]
        assert {r.module.split(".")[2] for r in decoder} == {str(i) for i in range(per_stage)}
        hf_layers = {int(m.split(".layers.")[1].split(".")[0]) for r in decoder for m in r.hf_modules}
        assert hf_layers == set(range(stage * per_stage, (stage + 1) * per_stage))
        assert (lw.UNEMBED_LAYER in {r.module for r in rules}) == (stage == pipeline - 1)
    unembed_only = LoraSpec(rank=2, train_attn=False, train_mlp=False)
    assert lw.lora_rules(shape, unembed_only, pipeline, 0) == []  # the first stage holds none of it
    hf = random_adapter(shape, SPEC)
    with pytest.raises(ValueError, match="unexpected"):  # a stage's layers need exactly their tensors
        lw.hf_to_local(stages[0], hf, shape, 1, 0)
    lw.check_names(whole, hf, shape)


def test_an_adapter_of_the_wrong_rank_is_refused_naming_the_tensor(shape: ModelShape) -> None:
    """A B with fewer rank columns than the spec's would otherwise broadcast into its parameter."""
    whole = lw.lora_rules(shape, SPEC)
    hf = random_adapter(shape, SPEC)
    lw.check_shapes(whole, hf, shape, SPEC.rank)
    name = lw.peft_names("model.layers.1.self_attn.k_proj")[1]
    narrow = {**hf, name: hf[name][:, :1].contiguous()}
    lw.check_names(whole, narrow, shape)  # the names alone are right
    with pytest.raises(ValueError, match=rf"rank-3 .*{name} \(\d+, 1\) \(expected \(\d+, 3\)\)"):
        lw.check_shapes(whole, narrow, shape, SPEC.rank)
