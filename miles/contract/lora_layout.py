"""What a LoRA adapter for a base model looks like, in PEFT's file format: which modules a LoRA config
targets, and the name and shape of every tensor an adapter of that base holds. The trainer builds its
adapters with these targets (miles.train.backends.lora); the gateway checks an uploaded adapter against
them (external weights uploads). Pure: shapes come from the base's safetensors headers, read by the caller.

PEFT stores module `<path>` (a Linear whose weight is `<path>.weight`, shape [out, in]) as
`base_model.model.<path>.lora_A.weight` [rank, in] and `base_model.model.<path>.lora_B.weight` [out, rank].
A tied unembedding (no `lm_head.weight` in the files) has the embedding's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
PEFT_PREFIX = "base_model.model."
TIED_UNEMBED_SOURCE = "model.embed_tokens.weight"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ADAPTER_DTYPES = frozenset({"F32", "BF16", "F16"})

# adapter_config.json settings this job's trainers and engines do not apply: a non-default one is refused
_UNSUPPORTED_SETTINGS: dict[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
}


def lora_targets(*, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    return [
        *(ATTN_MODULES if train_attn else ()),
        *(MLP_MODULES if train_mlp else ()),
        *(UNEMBED_MODULES if train_unembed else ()),
    ]


def adapter_layout(
    base_shapes: Mapping[str, Sequence[int]], rank: int, targets: Sequence[str]
) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an adapter of `rank` on `targets` over a base with these weight shapes."""
    layout: dict[str, tuple[int, ...]] = {}
    weights = dict(base_shapes)
    if "lm_head" in targets and "lm_head.weight" not in weights and TIED_UNEMBED_SOURCE in weights:
        weights["lm_head.weight"] = base_shapes[TIED_UNEMBED_SOURCE]
    for name, shape in weights.items():
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
            continue
        out_features, in_features = shape
        layout[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (rank, in_features)
        layout[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (out_features, rank)
    return layout


def config_problems(config: Any, rank: int, targets: Sequence[str]) -> list[str]:
    """What in an uploaded adapter_config.json disagrees with the declared LoRA config, or is a PEFT
    setting this job does not apply (empty: none)."""
    if not isinstance(config, dict):
        return ["adapter_config.json must be a JSON object (PEFT's LoraConfig)"]
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("r") != rank:
        problems.append(f"r is {config.get('r')!r} but the upload declared lora_config.rank {rank}")
    declared = config.get("target_modules")
    if not isinstance(declared, list) or sorted(map(str, declared)) != sorted(targets):
        problems.append(
            f"target_modules is {declared!r}; lora_config's train_attn/train_mlp/train_unembed give "
            f"{sorted(targets)}"
        )
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        problems.append(f"lora_alpha must be a positive number, got {alpha!r}")
    for key, default in _UNSUPPORTED_SETTINGS.items():
        value = config.get(key)
        if value is not None and value != default:
            problems.append(f"{key}={value!r} is not supported here (use {default!r})")
    return problems


def tensor_problems(
    found: Mapping[str, tuple[str, Sequence[int]]], expected: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """How the adapter's tensors (name -> (dtype, shape)) differ from the base's layout (empty: none)."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors the base has no module for, e.g. {unexpected[:3]}")
    for name in sorted(set(found) & set(expected)):
        dtype, shape = found[name]
        if tuple(shape) != expected[name]:
            problems.append(f"{name} has shape {list(shape)}; the base needs {list(expected[name])}")
        elif dtype not in ADAPTER_DTYPES:
            problems.append(f"{name} is {dtype}; adapters are F32, BF16 or F16")
        if len(problems) >= 5:
            break
    return problems
