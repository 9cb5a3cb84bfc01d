"""LoRA adapters in Hugging Face PEFT names <-> megatron's fused layers, and their tensor-parallel shards.

PEFT puts one (A, B) pair on each HF linear: q/k/v/o_proj, gate/up/down_proj, lm_head. megatron fuses q, k, v
into `linear_qkv` and gate, up into `linear_fc1`, so one megatron LoRA module stands for several PEFT pairs,
and keeps each pair's own A (a fused adapter with one shared A could not hold a PEFT adapter exactly):

- A: the parts' A matrices stacked, [parts x rank, in]. Output row j of the fused layer uses only the A of
  the part it belongs to (`part_ids`).
- B: fused exactly as the base weight is (grouped by KV head for qkv, [gate; up] for fc1), with rank columns
  in place of the hidden ones, so B's rows line up with the base layer's output rows.

Under tensor parallelism a column-parallel layer (qkv, fc1, output layer) keeps A whole on every rank and
cuts B by output rows as its base weight is cut; a row-parallel layer (proj, fc2) cuts A by input columns
and keeps B whole. Under pipeline parallelism a stage carries the LoRA layers of its own decoder layers
(named as its GPT names them, from 0) and, on the last stage, the output layer's. Pure torch: no megatron-core
import, so CI checks this mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from miles.contract.shape import ModelShape
from miles.train.megatron import shards
from miles.train.megatron.stages import stage_rules
from miles.train.megatron.weights import Fusion, TensorRule, TpKind, fuse, unfuse
from miles.types import LoraSpec

PEFT_PREFIX = "base_model.model."
ATTN_LAYERS = ("linear_qkv", "linear_proj")
MLP_LAYERS = ("linear_fc1", "linear_fc2")
UNEMBED_LAYER = "output_layer"


@dataclass(frozen=True)
class LoraRule:
    """One megatron layer that carries LoRA, and the HF modules it stands for (in fused order)."""

    module: str  # megatron module path, e.g. decoder.layers.0.self_attention.linear_qkv
    hf_modules: tuple[str, ...]  # e.g. model.layers.0.self_attn.q_proj, ...k_proj, ...v_proj
    fusion: Fusion
    base_kind: TpKind  # how TP cuts the base weight: column, gate_up, vocab (column-like) or row

    @property
    def row_parallel(self) -> bool:
        return self.base_kind == "row"

    @property
    def a_kind(self) -> TpKind:
        return "row" if self.row_parallel else "replicated"

    @property
    def b_kind(self) -> TpKind:
        return "replicated" if self.row_parallel else self.base_kind

    @property
    def a_name(self) -> str:
        return f"{self.module}.lora_A.weight"

    @property
    def b_name(self) -> str:
        return f"{self.module}.lora_B.weight"


def peft_names(hf_module: str) -> tuple[str, str]:
    """The PEFT state-dict names of one HF module's (A, B)."""
    return f"{PEFT_PREFIX}{hf_module}.lora_A.weight", f"{PEFT_PREFIX}{hf_module}.lora_B.weight"


def lora_rules(shape: ModelShape, spec: LoraSpec, pipeline: int = 1, stage: int = 0) -> list[LoraRule]:
    """The megatron layers `spec` puts LoRA on, in megatron's order: the whole model's, or pipeline stage
    `stage`'s (module paths as the stage's GPT names them; the HF modules keep the model's layer numbers)."""
    wanted = {
        *(ATTN_LAYERS if spec.train_attn else ()),
        *(MLP_LAYERS if spec.train_mlp else ()),
    }
    rules = []
    for rule in stage_rules(shape, pipeline, stage):
        module = rule.mcore_name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in wanted:
            hf = tuple(name.removesuffix(".weight") for name in rule.hf_names)
            rules.append(LoraRule(module, hf, rule.fusion, rule.tp_kind))
    # a tied model has no output weight of its own, but megatron keeps the layer (on the last stage)
    if spec.train_unembed and stage == pipeline - 1:
        rules.append(LoraRule(UNEMBED_LAYER, ("lm_head",), "none", "vocab"))
    return rules


def hf_names(rules: list[LoraRule], shape: ModelShape) -> list[str]:
    """The PEFT tensor names of `rules`' layers, in order."""
    return [name for rule in rules for name in hf_shapes(rule, shape, 1)]


def _fusion_rule(rule: LoraRule, names: tuple[str, ...]) -> TensorRule:
    return TensorRule(rule.module, names, rule.fusion, rule.base_kind)


def fuse_pair(
    rule: LoraRule, hf: Mapping[str, torch.Tensor], shape: ModelShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one megatron layer, unsharded, from its HF modules' PEFT tensors."""
    a_names, b_names = zip(*(peft_names(m) for m in rule.hf_modules), strict=True)
    a = torch.cat([hf[name] for name in a_names], dim=0)
    b = fuse(_fusion_rule(rule, b_names), hf, shape)
    return a, b


def unfuse_pair(
    rule: LoraRule, a: torch.Tensor, b: torch.Tensor, shape: ModelShape
) -> dict[str, torch.Tensor]:
    """The PEFT tensors of one megatron layer's unsharded (A, B): the inverse of `fuse_pair`."""
    a_names, b_names = zip(*(peft_names(m) for m in rule.hf_modules), strict=True)
    out = dict(zip(a_names, torch.chunk(a, len(a_names), dim=0), strict=True))
    out.update(unfuse(_fusion_rule(rule, b_names), b, shape))
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_shapes(rule: LoraRule, shape: ModelShape, rank: int) -> dict[str, tuple[int, int]]:
    """The PEFT (A, B) shapes of each HF module of `rule`, from the model's shape."""
    d, h = shape.head_dim, shape.hidden_size
    in_out = {
        "q_proj": (h, shape.num_heads * d),
        "k_proj": (h, shape.num_kv_heads * d),
        "v_proj": (h, shape.num_kv_heads * d),
        "o_proj": (shape.num_heads * d, h),
        "gate_proj": (h, shape.ffn_hidden_size),
        "up_proj": (h, shape.ffn_hidden_size),
        "down_proj": (shape.ffn_hidden_size, h),
        "lm_head": (h, shape.vocab_size),
    }
    shapes = {}
    for module in rule.hf_modules:
        fan_in, fan_out = in_out[module.rsplit(".", 1)[-1]]
        a_name, b_name = peft_names(module)
        shapes[a_name], shapes[b_name] = (rank, fan_in), (fan_out, rank)
    return shapes


def part_ids(rule: LoraRule, shape: ModelShape, tp: int, tp_rank: int) -> torch.Tensor:
    """For each of this rank's output rows of the layer, the index of the HF part (whose A) it uses.

    Built by fusing and sharding constant rows exactly as B is fused and sharded, so the two always agree."""
    rows = hf_shapes(rule, shape, 1)
    _, b_names = zip(*(peft_names(m) for m in rule.hf_modules), strict=True)
    marks = {name: torch.full((rows[name][0], 1), part) for part, name in enumerate(b_names)}
    full = fuse(_fusion_rule(rule, b_names), marks, shape)
    return shards.shard(full, rule.b_kind, tp, tp_rank)[:, 0].clone()


def part_rows(ids: torch.Tensor, parts: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """For `part_ids`: the rows of each part, and the permutation that puts the parts' outputs (concatenated
    in part order) back in row order (None for a one-part layer)."""
    rows = [torch.nonzero(ids == p)[:, 0] for p in range(parts)]
    return rows, (torch.argsort(torch.cat(rows)) if parts > 1 else None)


def apply_b(
    h: torch.Tensor, b: torch.Tensor, rows: list[torch.Tensor], inverse: torch.Tensor | None
) -> torch.Tensor:
    """Output row j = h[..., part(j)] . B[j] for h [..., parts x rank] (h = x A^T with A the stacked parts'
    A): each row of a fused layer sees only its own HF module's A."""
    if inverse is None:
        return h @ b.t()
    rank = h.shape[-1] // len(rows)
    pieces = [h[..., p * rank : (p + 1) * rank] @ b[part].t() for p, part in enumerate(rows)]
    return torch.cat(pieces, dim=-1)[..., inverse]


def check_names(rules: list[LoraRule], hf: Mapping[str, torch.Tensor], shape: ModelShape) -> None:
    """ValueError naming what differs unless `hf` holds exactly the PEFT tensors of `rules`' layers."""
    expected = set(hf_names(rules, shape))
    if set(hf) != expected:
        raise ValueError(
            f"adapter tensors do not match the LoRA layers: missing {sorted(expected - set(hf))[:3]}, "
            f"unexpected {sorted(set(hf) - expected)[:3]}"
        )


def check_shapes(rules: list[LoraRule], hf: Mapping[str, torch.Tensor], shape: ModelShape, rank: int) -> None:
    """ValueError naming the first tensors whose shape is not the one a rank-`rank` adapter of `rules`' layers
    has (names checked first: `check_names`). Without it a B of too few rank columns would load by
    broadcasting into the parameter, silently."""
    expected = {name: size for rule in rules for name, size in hf_shapes(rule, shape, rank).items()}
    wrong = [
        f"{name} {tuple(hf[name].shape)} (expected {size})"
        for name, size in expected.items()
        if name in hf and tuple(hf[name].shape) != size
    ]
    if wrong:
        raise ValueError(f"adapter tensors are not rank-{rank} LoRA tensors of this model: {wrong[:3]}")


def hf_to_local(
    rules: list[LoraRule], hf: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """A PEFT adapter state -> this TP rank's megatron tensors (`module.lora_A/B.weight`) of `rules`' layers;
    `hf` must hold exactly those layers' tensors."""
    check_names(rules, hf, shape)
    local = {}
    for rule in rules:
        a, b = fuse_pair(rule, hf, shape)
        local[rule.a_name] = shards.shard(a, rule.a_kind, tp, tp_rank)
        local[rule.b_name] = shards.shard(b, rule.b_kind, tp, tp_rank)
    return local


def merge_to_hf(
    rules: list[LoraRule], per_rank: list[Mapping[str, torch.Tensor]], shape: ModelShape
) -> dict[str, torch.Tensor]:
    """Every TP rank's megatron tensors (rank order) -> the whole PEFT adapter state."""
    hf: dict[str, torch.Tensor] = {}
    for rule in rules:
        a = shards.merge([rank[rule.a_name] for rank in per_rank], rule.a_kind)
        b = shards.merge([rank[rule.b_name] for rank in per_rank], rule.b_kind)
        hf.update(unfuse_pair(rule, a, b, shape))
    return hf
