from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.models.tiny import build_tiny_model


def test_tiny_model_is_deterministic_and_loadable(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # Qwen chat specials are single tokens, so chat renderers work on the tiny tokenizer
    assert len(tok("<|im_end|>")["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>"
    ids = tok("The trainer pushes the weights.")["input_ids"]
    assert tok.decode(ids) == "The trainer pushes the weights."
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
