"""save_weights_external's export: a standalone HF safetensors directory that plain transformers loads
(no peft) and that gives the trainer's own logprobs: LoRA merged into the base, full weights as trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

ROWS = [[3, 17, 90, 4, 55, 21], [8, 8, 300, 12]]


def _datum(tokens: list[int]) -> Datum:
    return Datum(
        model_input=np.asarray(tokens[:-1], np.int64),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def _trained(backend: TransformersBackend, key: str) -> list[np.ndarray]:
    """Two steps (LoRA's B starts at zero: only a trained adapter changes the model), then the logprobs."""
    data = [_datum(t) for t in ROWS]
    for _ in range(2):
        backend.forward_backward(key, data, "cross_entropy", {})
        backend.optim_step(key, AdamParams(learning_rate=5e-2))
    return backend.forward_backward(key, data, "cross_entropy", {}, forward_only=True).logprobs


def _hf_logprobs(model_dir: Path) -> list[np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for tokens in ROWS:
            logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
            rows = torch.log_softmax(logits, dim=-1)
            out.append(rows.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy())
    return out


@pytest.mark.parametrize("train_mode", ["lora", "full"])
def test_exported_weights_load_without_peft_and_reproduce_the_trainers_logprobs(
    tiny_model_dir: Path, tmp_path: Path, train_mode: str
) -> None:
    torch.manual_seed(0)
    backend = TransformersBackend(str(tiny_model_dir), train_mode=train_mode)
    key = "m"
    if train_mode == "lora":
        backend.create_adapter(key, LoraSpec(rank=4, seed=1))
    trained = _trained(backend, key)
    export = tmp_path / "export"
    backend.export_merged_hf_weights(key, export)

    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    assert not (export / "adapter_config.json").exists()  # a plain HF model, not a PEFT directory
    for got, want in zip(_hf_logprobs(export), trained, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # the export is the trained model, not the base it started from
    base = _hf_logprobs(tiny_model_dir)
    assert max(float(np.abs(b - t).max()) for b, t in zip(base, trained, strict=True)) > 1e-3


def test_a_lora_export_unties_the_unembedding_the_adapter_changed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    backend = TransformersBackend(str(tied), train_mode="lora")
    backend.create_adapter("u", LoraSpec(rank=2, seed=2, train_attn=False, train_mlp=False))
    trained = _trained(backend, "u")  # only lm_head carries LoRA
    backend.export_merged_hf_weights("u", tmp_path / "u")

    assert json.loads((tmp_path / "u" / "config.json").read_text())["tie_word_embeddings"] is False
    tensors = load_file(str(tmp_path / "u" / "model.safetensors"))
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    for got, want in zip(_hf_logprobs(tmp_path / "u"), trained, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
