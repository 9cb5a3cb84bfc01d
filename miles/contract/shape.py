"""A Qwen3 dense model's shape, read from its Hugging Face config (no torch, no transformers)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3",)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the megatron backend maps {', '.join(SUPPORTED_MODEL_TYPES)} (dense) checkpoints; this "
                f"model's config.json says model_type {model_type!r}: use model.backend: transformers"
            )
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: {heads} attention heads is not a multiple of {kv_heads} kv heads")
        hidden = int(config["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 1 << 31)),
            rope_theta=float(_rope_theta(config)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def _rope_theta(config: Mapping[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top level.
    params = config.get("rope_parameters") or {}
    return params.get("rope_theta", config.get("rope_theta", 10000.0))
