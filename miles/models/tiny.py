"""Build the tiny test model offline: a Qwen3-shaped config, seeded weights, a small BPE tokenizer.

Trainers, engines and tests all load the directory this writes, so they start from identical weights.
Nothing is downloaded: the tokenizer is trained with the `tokenizers` library on a corpus the project
ships (`miles/assets/tiny_corpus.txt`), and the weights come from `torch.manual_seed(seed)`.

A named shape (`TINY_SHAPES`, a preset's `model.init_shape`) picks the architecture: `tiny` (under a
million parameters, float32) or `qwen3-0.6b` (Qwen3-0.6B's exact shape in bfloat16, random weights: real
memory and step times without a download). The tokenizer stays the small BPE for every shape; ids it
does not know (a 151936-id model samples them) decode to nothing rather than failing.

    python -m miles.models.tiny OUT_DIR [--shape tiny] [--seed 0] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Literal

TINY_VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen's chat template, reduced to what the tiny model needs (no tools).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = TINY_VOCAB_SIZE
    max_position_embeddings: int = 2048
    seed: int = 0
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0  # Qwen3Config's default: the tiny model's config stays what it was
    rms_norm_eps: float = 1e-6
    dtype: Literal["float32", "bfloat16"] = "float32"  # of the saved weights and config (what "auto" loads)


# The shapes a preset's `model.init_shape` names (miles.contract.preset.model.InitShape: the same keys; a
# test keeps the two in step, as the contract cannot import this module).
TINY_SHAPES: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    # Qwen/Qwen3-0.6B's config.json: 0.6B parameters (0.44B without the tied 151936 x 1024 embedding).
    # bfloat16, as the real checkpoint is stored, so engines (dtype auto) and memory plans match it.
    "qwen3-0.6b": TinyModelSpec(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    ),
}


def tiny_spec(shape: str = "tiny", seed: int = 0) -> TinyModelSpec:
    """The spec of a named shape (`model.init_shape`), seeded."""
    if shape not in TINY_SHAPES:
        raise ValueError(f"unknown tiny model shape {shape!r}: use one of {', '.join(TINY_SHAPES)}")
    return replace(TINY_SHAPES[shape], seed=seed)


def _corpus_lines() -> list[str]:
    text = resources.files("miles.assets").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def build_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB_SIZE) -> None:
    """Train a byte-level BPE on the shipped corpus and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_config(spec: TinyModelSpec, eos_token_id: int, pad_token_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=spec.rms_norm_eps,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype=spec.dtype,
    )


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write config, tokenizer and seeded safetensors weights into `out_dir`; return it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    config = build_config(spec, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    # initialised in the saved dtype: the 0.6B shape in float32 would need twice the host memory
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    if spec.dtype != "float32":
        _write_legacy_dtype(out / "config.json", spec.dtype)
    (out / "miles_tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


def _write_legacy_dtype(config_file: Path, dtype: str) -> None:
    """Also write `torch_dtype`: transformers before 4.56 (an SGLang image may pin one) reads only that key
    and would load a bfloat16 checkpoint as float32 under dtype "auto"; newer ones read `dtype`."""
    config = json.loads(config_file.read_text())
    config["torch_dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.models.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=sorted(TINY_SHAPES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=None, help="override the shape's hidden size")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    args = parser.parse_args(argv)
    spec = tiny_spec(args.shape, args.seed)
    if args.hidden is not None:
        spec = replace(spec, hidden_size=args.hidden)
    if args.layers is not None:
        spec = replace(spec, num_hidden_layers=args.layers)
    out = build_tiny_model(args.out_dir, spec)
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
