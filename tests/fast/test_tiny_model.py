import json
import time
from dataclasses import replace
from pathlib import Path
from typing import get_args

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.contract.preset.model import InitShape
from miles.models.tiny import TINY_SHAPES, TinyModelSpec, build_config, build_tiny_model, tiny_spec


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


# ---- named shapes (model.init_shape) ----------------------------------------------------------------------


def test_the_named_shapes_are_the_presets_init_shapes() -> None:
    assert set(TINY_SHAPES) == set(get_args(InitShape))  # the contract cannot import this module
    assert tiny_spec("tiny") == TinyModelSpec()  # the tiny model is the one the project always built
    assert tiny_spec("qwen3-0.6b", seed=3).seed == 3
    with pytest.raises(
        ValueError, match=r"unknown tiny model shape 'qwen3-4b': use one of tiny, qwen3-0\.6b"
    ):
        tiny_spec("qwen3-4b")


def test_the_qwen3_06b_shape_is_qwen3_06b() -> None:
    """Its config and parameter count, on the meta device: building its weights takes ~15 s on 2 cores
    (1.2 GB of bfloat16), too slow for a fast test; the build path is tested below on a narrow copy."""
    config = build_config(TINY_SHAPES["qwen3-0.6b"], eos_token_id=2, pad_token_id=0)
    shape = {
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
    }
    assert {key: getattr(config, key) for key in shape} == shape
    assert config.rope_parameters["rope_theta"] == 1_000_000
    assert config.dtype == torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920  # Qwen/Qwen3-0.6B's count
    assert model.lm_head.weight is model.model.embed_tokens.weight


# Qwen3-0.6B's vocabulary, dtype and tied embedding on a narrow body: the 0.6B build path, fast
WIDE_VOCAB = replace(
    TINY_SHAPES["qwen3-0.6b"],
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("wide-vocab"), WIDE_VOCAB)


def test_a_bfloat16_shape_is_saved_and_loaded_as_bfloat16(wide_vocab_dir: Path) -> None:
    config = json.loads((wide_vocab_dir / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"  # new and old transformers alike
    with safe_open(str(wide_vocab_dir / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    assert "lm_head.weight" not in names  # tied: stored once, as the embedding
    model = AutoModelForCausalLM.from_pretrained(str(wide_vocab_dir), dtype="auto")
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 151936


def test_ids_beyond_the_small_tokenizer_decode_and_generate(wide_vocab_dir: Path) -> None:
    """The model samples any of 151936 ids; the small BPE knows under a thousand. Those it does not know
    decode to nothing (no error), and the CPU engine's /generate takes and returns them."""
    tok = AutoTokenizer.from_pretrained(str(wide_vocab_dir))
    known = tok("The trainer")["input_ids"]
    beyond = [len(tok), 5000, 151935]
    assert tok.decode(beyond) == "" and tok.decode(beyond, skip_special_tokens=True) == ""
    assert tok.decode(known + beyond) == "The trainer"

    from miles.engines.cpu.server import create_app
    from miles.utils.serving import ServerThread

    with ServerThread(create_app(str(wide_vocab_dir), served_model_name="wide")) as srv:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the CPU engine did not come up"
            time.sleep(0.05)
        body = {
            "input_ids": known + beyond,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        }
        response = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    assert len(out["output_ids"]) == 8 and isinstance(out["text"], str)
    assert max(out["output_ids"]) >= len(tok)  # random weights over 151936 ids: unknown ids were sampled
    assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
