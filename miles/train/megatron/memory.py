"""Per-GPU memory plan of the megatron backend for a model shape, a layout and a sequence length (pure).

What the backend holds (bf16 weights): weights 2 B per local parameter; megatron's DDP gradient buffer in
fp32, 4 B; the distributed optimizer's fp32 main copy and Adam's two moments, 12 B, split over DP ranks.
Activations with full recompute (one layer per checkpoint) are each layer's input, cut over TP by sequence
parallelism, plus one layer's working set while it is recomputed and back-propagated. The logprobs run in
chunks (miles.train.megatron.compute): the last hidden state, whole over the sequence on every TP rank, is
kept with its gradient (bf16), and the output layer's logits [chunk, vocab / TP] exist for one chunk at a
time, in bf16, in an fp32 copy and as its gradient. The working-set terms are estimates from the tensor
shapes, not measurements.

Context parallelism (CP) gives each rank seq / CP tokens of every activation term; weights and gradients are
replicated over CP, the optimizer is sharded over data x context ranks; and the layer being back-propagated
holds the whole sequence's K and V (gathered over CP, KV heads / TP) and their gradients.

    python -m miles.train.megatron.memory MODEL_DIR --tensor 8 --data 5 --seq 131072 [--context 2]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape

GIB = 1 << 30
LOGPROB_CHUNK_TOKENS = 2048  # tokens per output-layer chunk of the logprobs (compute.DEFAULT_CHUNK_TOKENS)


@dataclass(frozen=True)
class MemoryPlan:
    local_params: int
    weights: int
    grads: int
    optimizer: int
    layer_inputs: int
    layer_working_set: int
    logprob_hidden: int
    logits: int
    gathered_kv: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.layer_inputs
            + self.layer_working_set
            + self.logprob_hidden
            + self.logits
            + self.gathered_kv
        )


def local_params(shape: ModelShape, tp: int) -> int:
    """Parameters one TP rank holds (norms are replicated, everything else is cut over TP)."""
    h, d = shape.hidden_size, shape.head_dim
    attn = h * (shape.num_heads + 2 * shape.num_kv_heads) * d + shape.num_heads * d * h
    mlp = 3 * h * shape.ffn_hidden_size
    norms = 2 * h + 2 * d
    vocab = shape.vocab_size * h * (1 if shape.tie_embeddings else 2)
    return shape.num_layers * ((attn + mlp) // tp + norms) + vocab // tp + h


def plan(
    shape: ModelShape, layout: ParallelLayout, data: int, seq: int, chunk: int = LOGPROB_CHUNK_TOKENS
) -> MemoryPlan:
    """Per-GPU bytes; `seq`: the whole sequence (each CP rank holds seq / context of it)."""
    tp, cp = layout.tensor, layout.context
    params = local_params(shape, tp)
    s_rank = seq // cp
    s_local = s_rank // tp if layout.sequence_parallel else s_rank
    h, d = shape.hidden_size, shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d // tp
    # bf16 values kept by one recomputed layer for its backward, doubled for their gradients
    per_token = 2 * h + qkv + 2 * shape.num_heads * d // tp + 3 * shape.ffn_hidden_size // tp
    stored = shape.num_layers * s_local * h * 2 if layout.recompute == "full" else None
    if stored is None:  # without full recompute every layer keeps its working set
        stored = shape.num_layers * s_rank * per_token * 2
    kv_heads = max(shape.num_kv_heads // tp, 1)  # TP beyond the KV heads replicates one per rank
    return MemoryPlan(
        local_params=params,
        weights=2 * params,
        grads=4 * params,
        optimizer=12 * params // (data * cp),
        layer_inputs=stored,
        layer_working_set=2 * s_rank * per_token * 2,
        logprob_hidden=2 * s_rank * h * 2,
        logits=min(s_rank, chunk) * (shape.vocab_size // tp) * (2 + 4 + 4),
        # K and V of the whole sequence and their gradients, bf16 (CP 1: inside the working set)
        gathered_kv=2 * 2 * seq * kv_heads * d * 2 if cp > 1 else 0,
    )


def table(result: MemoryPlan) -> str:
    rows = [
        ("weights (bf16)", result.weights),
        ("gradients (fp32 DDP buffer)", result.grads),
        ("optimizer (fp32 main + Adam moments, / DP x CP)", result.optimizer),
        ("activations: layer inputs kept for recompute", result.layer_inputs),
        ("activations: one layer recomputed + its gradients", result.layer_working_set),
        ("logprobs: last hidden [seq, hidden] and its gradient", result.logprob_hidden),
        ("logits of one chunk [chunk, vocab/TP]: bf16, fp32 copy, gradient", result.logits),
        ("one layer's K and V gathered over CP [seq, kv heads/TP] and their gradients", result.gathered_kv),
        ("total", result.total),
    ]
    lines = ["| per GPU | GiB |", "| --- | ---: |"]
    lines += [f"| {name} | {value / GIB:.1f} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m miles.train.megatron.memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model_dir")
    parser.add_argument("--tensor", type=int, default=8)
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--context", type=int, default=1, help="context-parallel size")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    args = parser.parse_args(argv)
    shape = ModelShape.from_model_dir(args.model_dir)
    layout = ParallelLayout(
        tensor=args.tensor, context=args.context, sequence_parallel=args.tensor > 1, recompute=args.recompute
    )
    print(table(plan(shape, layout, args.data, args.seq)))


if __name__ == "__main__":
    main()
