"""Diagnostic (device): LoRA on the Qwen3-0.6B shape, bf16, eager vs compiled decoder layers.

Prints the step losses and the relative differences of the adapter gradients of steps 1 and 2, to tell a
compile bug from precision. Run: python3 tests/gpu/diag_lora_compile.py [batch seq_len] [tiny]
(`2 32 tiny` runs the tiny shape, on CPU where there is no CUDA, in about a minute).

Finding (docs/gpu.md): step-1 gradients agree (~1%), yet compiled LoRA lowers the loss faster, because
Inductor keeps the fused `base(x) + lora(x)` sum and the residual add in fp32 where eager rounds each op's
output to bf16, which swallows most of a small adapter delta. With
`torch._inductor.config.emulate_precision_casts = True` the compiled run equals eager exactly.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import train_throughput as bench  # noqa: E402

from miles.train.backends.transformers_backend import TransformersBackend  # noqa: E402
from miles.types import AdamParams, LoraSpec  # noqa: E402


def run(model_dir: Path, data, compiled: bool, steps: int = 4):
    backend = TransformersBackend(
        str(model_dir), train_mode="lora", device=DEV, dtype=torch.bfloat16, compile_layers=compiled
    )
    backend.create_adapter("k", LoraSpec(rank=32, alpha=32.0, seed=0, train_unembed=False))
    losses, first_grads = [], None
    for step in range(steps):
        out = backend.forward_backward("k", data, "cross_entropy", {})
        if step <= 1:
            grads = {
                n: p.grad.detach().float().cpu().clone() for n, p in backend.named_trainable_parameters("k")
            }
            first_grads = first_grads or grads
            if step == 1:
                second_grads = grads
        stats = backend.optim_step("k", AdamParams(learning_rate=1e-5))
        losses.append((out.metrics["loss:sum"], stats["grad_norm:mean"]))
    del backend
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return losses, first_grads, second_grads


def main() -> None:
    batch, seq = (
        (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 and sys.argv[1].isdigit() else (8, 2048)
    )
    setup = bench.Setup(DEV, torch.bfloat16, batch, seq, 2048)
    shape = bench.TINY if sys.argv[-1] == "tiny" else bench.QWEN3_0_6B
    data = bench.make_batch(shape["vocab_size"], setup)
    with tempfile.TemporaryDirectory() as tmp:
        bench.write_model(Path(tmp), shape, setup)
        eager = run(Path(tmp), data, compiled=False)
        comp = run(Path(tmp), data, compiled=True)
    print("eager (loss, grad_norm):", eager[0])
    print("compiled (loss, grad_norm):", comp[0])
    for label, index in (("step 1", 1), ("step 2", 2)):
        worst = []
        for name, g in eager[index].items():
            c = comp[index][name]
            rel = float((c - g).norm() / (g.norm() + 1e-30))
            worst.append((rel, name, float(g.norm()), float(c.norm())))
        worst.sort(reverse=True)
        print(label, "worst relative grad differences (rel, name, |eager|, |compiled|):")
        for row in worst[:6]:
            print("  ", row)
        zero_eager = sum(1 for n, g in eager[index].items() if float(g.abs().max()) == 0.0)
        zero_comp = sum(1 for n, g in comp[index].items() if float(g.abs().max()) == 0.0)
        print(f"   all-zero grads: eager {zero_eager}, compiled {zero_comp} of {len(eager[index])}")


if __name__ == "__main__":
    main()
