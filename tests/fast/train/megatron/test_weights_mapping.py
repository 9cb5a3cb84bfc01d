"""HF Qwen3 <-> megatron-core GPT weights and their tensor-parallel shards, on the tiny model (CPU, exact)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.contract.shape import ModelShape
from miles.train.megatron import shards
from miles.train.megatron.weights import hf_to_mcore, iter_hf_from_mcore, tensor_rules


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    return ModelShape.from_model_dir(tiny_model_dir), load_file(str(tiny_model_dir / "model.safetensors"))


def test_the_tiny_models_shape_is_read_from_its_config(tiny) -> None:
    shape, _ = tiny
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers) == (4, 2, 16, 2)
    assert (shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size, shape.tie_embeddings) == (
        64,
        128,
        1024,
        False,
    )


def test_a_model_type_other_than_qwen3_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"model\.backend: transformers"):
        ModelShape.from_hf_config({"model_type": "llama", "num_attention_heads": 4})


def test_hf_to_megatron_and_back_is_exact(tiny) -> None:
    shape, hf = tiny
    mcore = hf_to_mcore(hf, shape)
    assert len(mcore) == 2 + 8 * shape.num_layers + 1  # embedding, 8 per layer, final norm, output layer
    qkv = mcore["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim, shape.hidden_size)
    fc1 = mcore["decoder.layers.1.mlp.linear_fc1.weight"]
    assert fc1.shape == (2 * shape.ffn_hidden_size, shape.hidden_size)
    back = dict(iter_hf_from_mcore(mcore, shape))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_the_fused_qkv_is_grouped_by_kv_head(tiny) -> None:
    """Group g holds its query heads, then key head g, then value head g: what megatron's attention reads."""
    shape, hf = tiny
    qkv = hf_to_mcore(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = shape.head_dim, shape.heads_per_group
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    for g in range(shape.num_kv_heads):
        block = qkv[g * (per_group + 2) * d : (g + 1) * (per_group + 2) * d]
        assert torch.equal(block[: per_group * d], q[g * per_group * d : (g + 1) * per_group * d])
        assert torch.equal(block[per_group * d : (per_group + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[(per_group + 1) * d :], v[g * d : (g + 1) * d])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_tensor_kind_splits_and_merges_exactly(tiny, tp: int) -> None:
    shape, hf = tiny
    mcore = hf_to_mcore(hf, shape)
    kinds = set()
    for rule in tensor_rules(shape):
        full = mcore[rule.mcore_name]
        parts = shards.split(full, rule.tp_kind, tp)
        assert all(torch.equal(parts[r], shards.shard(full, rule.tp_kind, tp, r)) for r in range(tp))
        if rule.tp_kind != "replicated":
            assert sum(p.numel() for p in parts) == full.numel()
        assert torch.equal(shards.merge(parts, rule.tp_kind), full)
        kinds.add(rule.tp_kind)
    assert kinds == {"column", "row", "vocab", "gate_up", "replicated"}


def test_each_rank_computes_its_own_heads_and_mlp_slice_at_tp2(tiny) -> None:
    """What the cuts mean: rank r's qkv rows give exactly KV group r's q, k, v; its fc1 rows give gate and up
    for its slice of the MLP; the row-parallel shards' partial outputs sum to the full output."""
    shape, hf = tiny
    tp, layer = 2, "model.layers.1."
    mcore = hf_to_mcore(hf, shape)
    x = torch.randn(3, shape.hidden_size, dtype=torch.float64)
    d, per_group, ffn = shape.head_dim, shape.heads_per_group, shape.ffn_hidden_size // tp
    qkv = mcore["decoder.layers.1.self_attention.linear_qkv.weight"].double()
    fc1 = mcore["decoder.layers.1.mlp.linear_fc1.weight"].double()
    hf64 = {n: t.double() for n, t in hf.items() if n.startswith(layer)}
    for r in range(tp):
        out = x @ shards.shard(qkv, "column", tp, r).T
        q, k, v = out.split([per_group * d, d, d], dim=-1)
        q_rows = slice(r * per_group * d, (r + 1) * per_group * d)
        assert torch.allclose(q, x @ hf64[f"{layer}self_attn.q_proj.weight"][q_rows].T)
        assert torch.allclose(k, x @ hf64[f"{layer}self_attn.k_proj.weight"][r * d : (r + 1) * d].T)
        assert torch.allclose(v, x @ hf64[f"{layer}self_attn.v_proj.weight"][r * d : (r + 1) * d].T)
        gate, up = (x @ shards.shard(fc1, "gate_up", tp, r).T).chunk(2, dim=-1)
        assert torch.allclose(gate, x @ hf64[f"{layer}mlp.gate_proj.weight"][r * ffn : (r + 1) * ffn].T)
        assert torch.allclose(up, x @ hf64[f"{layer}mlp.up_proj.weight"][r * ffn : (r + 1) * ffn].T)
    down = hf64[f"{layer}mlp.down_proj.weight"]
    act = torch.randn(3, shape.ffn_hidden_size, dtype=torch.float64)
    partial = [act[:, r * ffn : (r + 1) * ffn] @ shards.shard(down, "row", tp, r).T for r in range(tp)]
    assert torch.allclose(sum(partial), act @ down.T)


def test_a_tied_model_has_no_output_layer_and_exports_no_lm_head(tiny) -> None:
    shape, hf = tiny
    tied = dataclasses.replace(shape, tie_embeddings=True)
    with_head = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}
    mcore = hf_to_mcore(with_head, tied)
    assert "output_layer.weight" not in mcore
    assert "lm_head.weight" not in dict(iter_hf_from_mcore(mcore, tied))


def test_unknown_hf_tensors_are_named(tiny) -> None:
    shape, hf = tiny
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0"):
        hf_to_mcore({**hf, "model.layers.0.mlp.experts.0.weight": torch.zeros(1)}, shape)


def test_pipeline_stages_partition_the_tensors(tiny) -> None:
    shape, _ = tiny
    whole = [rule.mcore_name for rule in tensor_rules(shape)]
    stages = [rule.mcore_name for half in (range(0, 1), range(1, 2)) for rule in tensor_rules(shape, half)]
    assert stages == whole
    assert tensor_rules(shape, range(1, 2))[-1].mcore_name == "output_layer.weight"
