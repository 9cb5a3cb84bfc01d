"""The worker builds the backend a preset names; megatron-core is imported only for model.backend megatron."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.errors import UserError
from miles.train.backends.factory import build_backend


def test_an_unknown_backend_names_the_choices(tiny_model_dir: Path) -> None:
    with pytest.raises(UserError, match="use one of transformers, megatron"):
        build_backend("deepspeed", str(tiny_model_dir), train_mode="full")


def test_the_transformers_backend_is_the_default_kind(tiny_model_dir: Path) -> None:
    backend = build_backend("transformers", str(tiny_model_dir), train_mode="full")
    assert type(backend).__name__ == "TransformersBackend" and backend.model_keys() == ["full"]


def test_megatron_refuses_lora_or_says_what_to_install(tiny_model_dir: Path) -> None:
    """Before any model loads: LoRA on megatron is refused with the fix; without megatron-core the error
    names the extra to install."""
    with pytest.raises(UserError) as caught:
        build_backend("megatron", str(tiny_model_dir), train_mode="lora")
    if importlib.util.find_spec("megatron") is None:
        assert "pip install 'miles-hpc[runtime,gpu]'" in str(caught.value)
    else:
        assert "for LoRA use model.backend: transformers" in str(caught.value)
