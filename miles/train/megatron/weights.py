"""Hugging Face Qwen3 (dense) <-> megatron-core GPT weights, one megatron tensor at a time.

Megatron fuses what HF keeps apart: `linear_qkv` holds q, k and v grouped by KV head (for each of the
`num_kv_heads` groups: its `heads_per_group` query heads, then its key head, then its value head), and
`linear_fc1` holds gate then up. Everything else is a rename. Working one megatron tensor at a time lets a
rank load only its own shards from the checkpoint and lets the weight push convert bucket by bucket.

The names are those of megatron-core's GPTModel built with the local layer spec (no Transformer Engine:
the norms before attention and MLP are their own modules, `input_layernorm` and `pre_mlp_layernorm`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from miles.contract.shape import ModelShape

Fusion = Literal["none", "qkv", "gate_up"]
# How tensor parallelism cuts a tensor: column (output rows), row (input columns), vocab (embedding and
# output rows), gate_up (column, cutting gate and up separately so each rank holds [gate_r; up_r]), or
# replicated (norms).
TpKind = Literal["column", "row", "vocab", "gate_up", "replicated"]


@dataclass(frozen=True)
class TensorRule:
    mcore_name: str
    hf_names: tuple[str, ...]
    fusion: Fusion
    tp_kind: TpKind


def _layer_rules(i: int) -> list[TensorRule]:
    hf = f"model.layers.{i}."
    mc = f"decoder.layers.{i}."
    attn = f"{hf}self_attn."
    return [
        TensorRule(f"{mc}input_layernorm.weight", (f"{hf}input_layernorm.weight",), "none", "replicated"),
        TensorRule(
            f"{mc}self_attention.linear_qkv.weight",
            (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
            "qkv",
            "column",
        ),
        TensorRule(f"{mc}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "none", "replicated"),
        TensorRule(f"{mc}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "none", "replicated"),
        TensorRule(f"{mc}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "none", "row"),
        TensorRule(
            f"{mc}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",), "none", "replicated"
        ),
        TensorRule(
            f"{mc}mlp.linear_fc1.weight",
            (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
            "gate_up",
            "gate_up",
        ),
        TensorRule(f"{mc}mlp.linear_fc2.weight", (f"{hf}mlp.down_proj.weight",), "none", "row"),
    ]


def tensor_rules(shape: ModelShape, layers: range | None = None) -> list[TensorRule]:
    """Every megatron tensor of the model (or of `layers`, one pipeline stage's), in megatron's order.

    The embedding belongs to the first stage and the final norm and output layer to the last; a tied model
    has no output layer (megatron shares the embedding)."""
    layers = range(shape.num_layers) if layers is None else layers
    rules: list[TensorRule] = []
    if layers.start == 0:
        rules.append(
            TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "none", "vocab")
        )
    for i in layers:
        rules += _layer_rules(i)
    if layers.stop == shape.num_layers:
        norm = TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), "none", "replicated")
        rules.append(norm)
        if not shape.tie_embeddings:
            rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), "none", "vocab"))
    return rules


def fuse(rule: TensorRule, hf_tensors: Mapping[str, torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The megatron tensor of `rule` from its HF tensors (unsharded)."""
    parts = [hf_tensors[name] for name in rule.hf_names]
    if rule.fusion == "qkv":
        q, k, v = parts
        hidden = q.shape[-1]
        groups = shape.num_kv_heads
        grouped = torch.cat(
            [
                q.reshape(groups, shape.heads_per_group * shape.head_dim, hidden),
                k.reshape(groups, shape.head_dim, hidden),
                v.reshape(groups, shape.head_dim, hidden),
            ],
            dim=1,
        )
        return grouped.reshape(-1, hidden)
    if rule.fusion == "gate_up":
        return torch.cat(parts, dim=0)
    return parts[0]


def unfuse(rule: TensorRule, tensor: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of one unsharded megatron tensor: the inverse of `fuse`."""
    if rule.fusion == "qkv":
        hidden = tensor.shape[-1]
        d = shape.head_dim
        grouped = tensor.reshape(shape.num_kv_heads, (shape.heads_per_group + 2) * d, hidden)
        q, k, v = torch.split(grouped, [shape.heads_per_group * d, d, d], dim=1)
        pieces = [t.reshape(-1, hidden) for t in (q, k, v)]
        return list(zip(rule.hf_names, pieces, strict=True))
    if rule.fusion == "gate_up":
        return list(zip(rule.hf_names, torch.chunk(tensor, 2, dim=0), strict=True))
    return [(rule.hf_names[0], tensor)]


def hf_to_mcore(hf_state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """A whole HF state dict in megatron names (unsharded); HF tensors no rule names are an error."""
    rules = tensor_rules(shape)
    used = {name for rule in rules for name in rule.hf_names}
    # a tied checkpoint may still carry lm_head.weight (the same tensor as the embedding)
    unknown = sorted(set(hf_state) - used - ({"lm_head.weight"} if shape.tie_embeddings else set()))
    if unknown:
        raise ValueError(f"HF tensors the Qwen3 mapping does not know: {unknown[:5]}")
    return {rule.mcore_name: fuse(rule, hf_state, shape) for rule in rules}


def iter_hf_from_mcore(
    mcore_state: Mapping[str, torch.Tensor], shape: ModelShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for a whole unsharded megatron state, in megatron order."""
    for rule in tensor_rules(shape):
        yield from unfuse(rule, mcore_state[rule.mcore_name], shape)
