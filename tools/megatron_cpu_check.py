"""Run the megatron backend on CPU over gloo against the transformers backend (a developer check, not a test).

megatron-core 0.16.1 cannot run on CPU as shipped: its rotary embedding moves its frequencies to
`torch.cuda.current_device()` (and, under context parallelism, slices it with a pinned index moved to
CUDA), its optimizer and gradient-norm code allocate small buffers on 'cuda', its
distributed optimizer accepts only `torch.cuda.*Tensor` parameters, and under sequence parallelism its
embedding forks the CUDA RNG tracker. The megatron backend on CPU redirects exactly those to the CPU
(miles/train/megatron/cpu.py), so the model maths, the TP/DP collectives (gloo) and the backend's own logic
run for real on a laptop.
It found the TP > 1 gradient bugs fixed in 0ceea91. Needs the gpu extra (megatron-core) in the venv.

    .venv/bin/python tools/megatron_cpu_check.py MODEL_DIR --tensor 2 [--sequence-parallel] [--ranks 2]
        [--pipeline P] [--context C]
    (MODEL_DIR: e.g. `python -m miles.models.tiny /tmp/tiny`)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from miles.engines.weight_group import pick_master_port
from miles.train.dist import DistContext
from miles.train.megatron.cpu import run_on_cpu
from miles.types import AdamParams, Datum

ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
CHUNK = 4  # tokens per output-layer chunk in the chunked-logprobs check: every datum spans several


def batch(vocab: int) -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for n in (5, 9, 7, 12):
        tokens = rng.integers(0, vocab, n + 1)
        weights = rng.uniform(0, 1, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    run_on_cpu()
    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.backends.transformers_backend import TransformersBackend

    store = dist.TCPStore("127.0.0.1", port, world_size=args.ranks, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    parallel = {"tensor": args.tensor, "sequence_parallel": args.sequence_parallel}
    parallel["recompute"] = args.recompute
    parallel["pipeline"] = args.pipeline
    parallel["context"] = args.context
    if args.lora:
        lora_check(rank, args, parallel)
        return
    mc = MegatronBackend(
        args.model_dir, train_mode="full", device="cpu", dtype=torch.float32,
        dist=DistContext(rank, args.ranks), parallel=parallel,
        max_tokens_per_micro_batch=args.micro_batch_tokens,
    )  # fmt: skip
    data = batch(mc.vocab_size)
    # the whole-model output layer is one stage's: the chunked path is checked without pipeline stages
    # (and without CP, whose ranks hold two chunks of each row, not the rows the full-logits path takes)
    chunk_diffs = chunked_against_full_logits(mc, data) if args.pipeline == args.context == 1 else None
    got = mc.forward_backward("full", data, "cross_entropy", {})
    got_step = mc.optim_step("full", ADAM)
    got_after = mc.forward_backward("full", data, "cross_entropy", {}, forward_only=True)
    if rank != 0:
        return
    ref = TransformersBackend(args.model_dir, train_mode="full", device="cpu", dtype=torch.float32)
    want = ref.forward_backward("full", data, "cross_entropy", {})
    want_step = ref.optim_step("full", ADAM)
    want_after = ref.forward_backward("full", data, "cross_entropy", {}, forward_only=True)
    print(f"layout {parallel} over {args.ranks} ranks, fp32, against the transformers backend:")
    norms = (got_step["grad_norm:mean"], want_step["grad_norm:mean"])
    print(f"  logprobs max |diff|            {max_diff(got.logprobs, want.logprobs):.2e}")
    print(f"  grad norm                      {norms[0]:.5f} vs {norms[1]:.5f}")
    print(f"  logprobs after one AdamW step  {max_diff(got_after.logprobs, want_after.logprobs):.2e}")
    losses = (got.metrics["loss:sum"], want.metrics["loss:sum"])
    print(f"  loss                           {losses[0]:.6f} vs {losses[1]:.6f}")
    if chunk_diffs is None:
        return
    print(f"  chunked ({CHUNK} tokens) against megatron's full-logits output layer, rank 0:")
    print(f"    logprobs max |diff| {chunk_diffs[0]:.2e}, gradient buffer max |diff| {chunk_diffs[1]:.2e}")


def chunked_against_full_logits(mc, data: list[Datum]) -> tuple[float, float]:
    """(logprobs, gradient) max |diff| of the chunked logprob path against the unchunked one it replaced:
    the GPT's own output layer over the whole batch, then vocab_parallel_cross_entropy. Leaves no gradient."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from miles.train.backends.compute import datum_loss
    from miles.train.losses import get_loss
    from miles.train.megatron import compute

    params = [p for p in mc.gpt.parameters() if p.requires_grad]
    ce = get_loss("cross_entropy")

    def backward(per_datum: list[torch.Tensor]) -> list[torch.Tensor]:
        losses = [datum_loss(d, lp, ce, {}, mc.device).sum() for d, lp in zip(data, per_datum, strict=True)]
        torch.stack(losses).sum().backward()
        grads = [p.main_grad.detach().clone() for p in params]
        mc.ddp.zero_grad_buffer()
        return grads

    chunked = compute.target_logprobs(mc.ddp, data, mc.device, mc._pad, chunk_tokens=CHUNK)
    chunked_grads = backward(chunked)
    input_ids, targets = compute._padded(data, mc._pad, mc.device)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    logits = mc.ddp(input_ids, positions, attention_mask=None)  # [b, w, vocab / TP]
    full = -vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), targets)
    full_rows = [full[row, : len(d.model_input)] for row, d in enumerate(data)]
    full_grads = backward(full_rows)
    lp_diff = max(float((a - b).abs().max()) for a, b in zip(chunked, full_rows, strict=True))
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(chunked_grads, full_grads, strict=True))
    return lp_diff, grad_diff


def lora_check(rank: int, args: argparse.Namespace, parallel: dict) -> None:
    """The same adapter (the transformers backend's, B made non-zero) on both backends: logprobs, the
    gradients in PEFT names, one AdamW step, and the exported adapter's tensors."""
    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.backends.transformers_backend import TransformersBackend
    from miles.types import LoraSpec

    spec = LoraSpec(rank=4, seed=1)
    ref = TransformersBackend(args.model_dir, train_mode="lora", device="cpu", dtype=torch.float32)
    ref.create_adapter("a", spec)
    adapter = ref.lora.get("a")
    generator = torch.Generator().manual_seed(0)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=generator) if ".lora_B." in k else v
        for k, v in ref.lora.state_dict(adapter).items()
    }
    ref.lora.load_state_dict(adapter, state)
    mc = MegatronBackend(
        args.model_dir, train_mode="lora", device="cpu", dtype=torch.float32,
        dist=DistContext(rank, args.ranks), parallel=parallel,
    )  # fmt: skip
    mc.create_adapter("a", spec)
    mc.lora.adapters.load_hf(mc.lora.adapters.get("a"), state)
    data = batch(mc.vocab_size)
    got = mc.forward_backward("a", data, "cross_entropy", {})
    want = ref.forward_backward("a", data, "cross_entropy", {})
    got_grads = mc.lora.hf_gradients("a")
    want_grads = {
        f"base_model.model.{n.removeprefix('base_model.model.')}": p.grad
        for n, p in ref.named_trainable_parameters("a")
    }
    # rank 0 holds every pipeline stage's gradients; read before the step clips them in place
    grad_diff = 0.0
    if rank == 0:
        grad_diff = max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items())
    got_step, want_step = mc.optim_step("a", ADAM), ref.optim_step("a", ADAM)
    got_after = mc.forward_backward("a", data, "cross_entropy", {}, forward_only=True)
    want_after = ref.forward_backward("a", data, "cross_entropy", {}, forward_only=True)
    if rank != 0:
        return
    print(f"LoRA, layout {parallel} over {args.ranks} ranks, fp32, against the transformers backend:")
    print(f"  same PEFT names                {sorted(got_grads) == sorted(want_grads)} ({len(want_grads)})")
    print(f"  logprobs max |diff|            {max_diff(got.logprobs, want.logprobs):.2e}")
    # with DP each rank holds its share's; with TP the output layer's A is partial per rank until the step
    if args.tensor == 1 and args.ranks == args.pipeline:
        print(f"  gradients max |diff|           {grad_diff:.2e}")
    norms = (got_step["grad_norm:mean"], want_step["grad_norm:mean"])
    print(f"  grad norm                      {norms[0]:.5f} vs {norms[1]:.5f}")
    print(f"  logprobs after one AdamW step  {max_diff(got_after.logprobs, want_after.logprobs):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--lora", action="store_true", help="a LoRA adapter instead of full fine-tuning")
    parser.add_argument("--pipeline", type=int, default=1, help="pipeline stages")
    parser.add_argument("--context", type=int, default=1, help="context-parallel size (full fine-tuning)")
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=16384, help="24: the batch runs as 3 micro-batches"
    )
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    args = parser.parse_args()
    torch_mp.spawn(rank_main, args=(args, pick_master_port("127.0.0.1")), nprocs=args.ranks)


if __name__ == "__main__":
    main()
