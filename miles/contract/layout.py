"""The megatron backend's parallel layout: sizes, and the checks that tie them to the GPUs and the model.

Pure (no torch): the preset runs these checks when it loads (`miles.contract.preset`), the launcher at
submit against the model's config (`launcher.submit_checks`), and the backend again when it starts, on
the model it actually loads. Every problem names the key to change and to what.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.contract.shape import ModelShape

if TYPE_CHECKING:  # the preset package imports these checks: the layout is named for its type only
    from miles.contract.preset.model import ParallelLayout


def gpu_problems(layout: ParallelLayout, trainer_gpus: int, key: str = "model.parallel") -> list[str]:
    """The sizes against the trainer GPUs (tensor x pipeline x context x data must be all of them)."""
    problems = []
    mp = layout.model_parallel
    sizes = f"tensor {layout.tensor} x pipeline {layout.pipeline} x context {layout.context}"
    if trainer_gpus % mp:
        fits = [d for d in range(1, trainer_gpus + 1) if trainer_gpus % d == 0]
        problems.append(
            f"{key}: {sizes} = {mp} does not divide the {trainer_gpus} trainer GPUs; choose sizes whose "
            f"product is one of {fits}"
        )
    elif layout.data is not None and layout.data * mp != trainer_gpus:
        problems.append(
            f"{key}.data: {layout.data} x ({sizes}) is {layout.data * mp}, not the {trainer_gpus} trainer "
            f"GPUs; set data to {trainer_gpus // mp} or leave it unset"
        )
    if layout.sequence_parallel and layout.tensor == 1:
        problems.append(
            f"{key}.sequence_parallel: needs tensor > 1 (it splits the sequence over TP ranks); set tensor "
            "above 1 or sequence_parallel to false"
        )
    return problems


def train_mode_problems(layout: ParallelLayout, train_mode: str, key: str = "model.parallel") -> list[str]:
    """The sizes against the training mode: none refused today. LoRA runs every size that full fine-tuning
    runs, pipeline stages included (each stage holds its own layers' adapters) and context parallelism (the
    adapters' gradients are summed over data x context ranks); a limit of one mode goes here."""
    return []


def model_problems(
    layout: ParallelLayout, shape: ModelShape, max_context: int | None = None, key: str = "model.parallel"
) -> list[str]:
    """The sizes against the model: heads, KV heads, layers, vocabulary, and the preset's context length
    (`max_context`; the backend passes none: it pads every micro-batch to 2 x context, so the model's own
    max_position_embeddings need not divide)."""
    problems = []
    tp = layout.tensor
    choose = f"choose tensor from {tensor_sizes(shape)}"
    if shape.num_heads % tp:
        problems.append(
            f"{key}.tensor: {tp} must divide the model's {shape.num_heads} attention heads; {choose}"
        )
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        problems.append(
            f"{key}.tensor: {tp} and the model's {shape.num_kv_heads} KV heads must divide one another; "
            + choose
        )
    if shape.ffn_hidden_size % tp:
        problems.append(f"{key}.tensor: {tp} must divide the MLP width {shape.ffn_hidden_size}; {choose}")
    if shape.vocab_size % tp:
        problems.append(
            f"{key}.tensor: {tp} must divide the vocabulary ({shape.vocab_size} tokens); {choose}"
        )
    if shape.num_layers % layout.pipeline:
        problems.append(
            f"{key}.pipeline: {layout.pipeline} must divide the model's {shape.num_layers} layers; choose "
            f"pipeline from {_divisors(shape.num_layers)}"
        )
    return problems + (context_problems(layout, max_context, key) if max_context is not None else [])


def tensor_sizes(shape: ModelShape) -> list[int]:
    """The tensor-parallel sizes this model takes: dividing its heads, MLP width and vocabulary, and its KV
    heads dividing or divided by them."""
    kv = shape.num_kv_heads
    return [
        t
        for t in _divisors(shape.num_heads)
        if not shape.ffn_hidden_size % t and not shape.vocab_size % t and (not kv % t or not t % kv)
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_problems(layout: ParallelLayout, max_context: int, key: str = "model.parallel") -> list[str]:
    """The context-parallel size against the context length: needs no model, so a preset is checked when it
    loads (whether or not its model is on this machine yet)."""
    cut = 2 * layout.context
    if layout.context == 1 or not max_context % cut:
        return []
    lower = max_context - max_context % cut
    lengths = " or ".join(str(n) for n in (lower, lower + cut) if n > 0)
    fits = [c for c in range(1, cut + 1) if c == 1 or not max_context % (2 * c)]
    return [
        f"{key}.context: model.max_context {max_context} must be a multiple of 2 x context ({cut}): each CP "
        f"rank takes two balanced chunks of the sequence; set model.max_context to {lengths}, or context to "
        f"one of {fits}"
    ]
