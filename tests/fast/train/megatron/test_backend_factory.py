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


def test_megatron_refuses_an_unknown_train_mode_or_says_what_to_install(tiny_model_dir: Path) -> None:
    """Before any model loads: a train_mode other than lora / full is refused; without megatron-core the
    error names the extra to install."""
    with pytest.raises(UserError) as caught:
        build_backend("megatron", str(tiny_model_dir), train_mode="adapters")
    if importlib.util.find_spec("megatron") is None:
        assert "pip install 'miles-hpc[runtime,gpu]'" in str(caught.value)
    else:
        assert "train_mode must be 'lora' or 'full', got 'adapters'" in str(caught.value)


def test_the_preset_names_the_backend_and_its_sizes_to_the_trainer_ranks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from launcher.presets import load_preset
    from miles.driver.bringup import cell_settings

    big = cell_settings(load_preset("qwen3.8-27b-128k", env={}), tiny_model_dir, tmp_path)
    assert big.backend_kwargs() == {
        "backend": "megatron",
        "parallel": {
            "tensor": 8, "pipeline": 1, "context": 1, "data": None, "sequence_parallel": True,
            "recompute": "full",
        },
    }  # fmt: skip
    tiny = cell_settings(load_preset("tiny-cpu", env={}), tiny_model_dir, tmp_path)
    assert tiny.backend_kwargs() == {}  # the transformers backend takes no backend keys
