"""Build the tiny test model offline: a Qwen3-shaped config, seeded weights, a small BPE tokenizer.

Trainers, engines and tests all load the directory this writes, so they start from identical weights.
Nothing is downloaded: the tokenizer is trained with the `tokenizers` library on a corpus the project
ships (`miles/assets/tiny_corpus.txt`), and the weights come from `torch.manual_seed(seed)`.

    python -m miles.models.tiny OUT_DIR [--seed 0] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

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
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
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
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "miles_tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.models.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=TinyModelSpec.hidden_size)
    parser.add_argument("--layers", type=int, default=TinyModelSpec.num_hidden_layers)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(hidden_size=args.hidden, num_hidden_layers=args.layers, seed=args.seed)
    out = build_tiny_model(args.out_dir, spec)
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
