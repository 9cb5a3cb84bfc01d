"""LoRA adapters read from a PEFT directory and applied by merging their deltas into the base weights.

Merging (W + scale * B @ A) instead of wrapping the model with peft keeps parameter names plain HF names,
so full-weight updates and adapters never disagree about names. The engine keeps a copy of every base
weight an active adapter touched and restores it exactly before switching adapter or loading new weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """The adapter directory cannot be used (missing files, unsupported options, unknown modules)."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    deltas: dict[str, torch.Tensor]  # HF parameter name -> delta with the parameter's shape


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory: adapter_config.json is missing")
    cfg = json.loads(cfg_file.read_text())
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
    }
    bad = [k for k, on in unsupported.items() if on]
    if bad:
        raise AdapterError(f"adapter {path} uses options the CPU engine does not support: {bad}")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        return load_file(str(st))
    binary = path / "adapter_model.bin"
    if binary.is_file():
        return torch.load(str(binary), map_location="cpu", weights_only=True)
    raise AdapterError(f"{path} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(name: str, path: str, param_shapes: dict[str, torch.Size]) -> LoraAdapter:
    """Read `path` and turn each (A, B) pair into the delta of one base parameter."""
    root = Path(path).resolve()
    cfg = _read_config(root)
    tensors = _read_tensors(root)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            marker = f".{part}"
            if marker in module:
                module_name = module.split(marker)[0]
                pairs.setdefault(module_name, {})[part] = tensor.float()
                break
        else:
            _check_saved_base_weight(root, key, module, tensor, param_shapes)
    deltas = {module + ".weight": _delta(module, parts, cfg, root) for module, parts in pairs.items()}
    for param, delta in deltas.items():
        if param not in param_shapes:
            raise AdapterError(f"adapter {root} targets {param!r}, which the base model does not have")
        if tuple(delta.shape) != tuple(param_shapes[param]):
            raise AdapterError(
                f"adapter {root}: delta for {param!r} has shape {tuple(delta.shape)}, "
                f"the base weight has {tuple(param_shapes[param])}"
            )
    return LoraAdapter(name=name, path=str(root), deltas=deltas)


def _check_saved_base_weight(
    root: Path, key: str, module: str, tensor: torch.Tensor, param_shapes: dict[str, torch.Size]
) -> None:
    """peft saves full embedding/lm_head weights next to the pairs (for resized vocabularies); with an
    unchanged vocabulary they are copies of the frozen base weights, so they are skipped, never loaded."""
    name = module.replace(".base_layer.", ".")
    if tuple(param_shapes.get(name, ())) != tuple(tensor.shape):
        raise AdapterError(
            f"adapter {root}: tensor {key!r} is neither a LoRA A/B matrix nor a same-shape base weight "
            "(resized vocabularies and modules_to_save are not supported)"
        )


def _delta(module: str, parts: dict[str, torch.Tensor], cfg: dict, root: Path) -> torch.Tensor:
    if "lora_A" in parts and "lora_B" in parts:
        a, b = parts["lora_A"], parts["lora_B"]
        rank = a.shape[0]
        product = b @ a
    elif "lora_embedding_A" in parts and "lora_embedding_B" in parts:
        a, b = parts["lora_embedding_A"], parts["lora_embedding_B"]
        rank = a.shape[0]
        product = (b @ a).T
    else:
        raise AdapterError(f"adapter {root}: module {module!r} lacks its A or B matrix")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return product * scale
