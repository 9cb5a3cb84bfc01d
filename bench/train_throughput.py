"""Training throughput: our TransformersBackend vs a plain PyTorch/PEFT loop, same model, batch and run.

    python bench/train_throughput.py            # Qwen3-0.6B-shaped, bf16, 8 x 2048 tokens, CUDA
    python bench/train_throughput.py --small    # tiny config on CPU in seconds (checks both sides agree)
    ... [--json] [--modes full,lora] [--variants plain,ours,ours_compiled] [--steps 10] [--warmup 3]
    python bench/train_throughput.py --backend megatron   # + the megatron backend (TP 1), full mode

`--backend megatron` adds the variant `megatron` (MegatronBackend on one GPU: megatron-core's GPT, its DDP
with an fp32 gradient buffer and its distributed optimizer, chunked vocab-parallel logprobs) next to the
plain loop and the transformers backend, full fine-tuning only (needs the gpu extra; with --small it runs
on CPU through tools/megatron_cpu_check.py's redirection of megatron's few CUDA calls).

One step = forward_backward (cross_entropy, every weight 1) + optim_step (AdamW) over the whole batch.
The plain loop is what a researcher writes first: eager HF forward, fp32 logits, summed cross-entropy,
AdamW(fused) on CUDA. Both sides start from the same random weights (a model directory written once), so
their step losses agree; the table gives tokens/s, peak memory (torch.cuda.max_memory_allocated) and
both as ratios against the plain loop of the same mode measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from miles.train.backends.transformers_backend import TransformersBackend  # noqa: E402
from miles.types import AdamParams, Datum, LoraSpec  # noqa: E402

LR = 1e-5
LORA_RANK = 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("plain", "ours", "ours_compiled", "megatron")

# Qwen3-0.6B's shape (random weights: nothing is downloaded).
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
# Qwen3-4B's shape (the part 2).
QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B}
H200_DENSE_BF16_FLOPS = 989e12
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: torch.dtype
    batch: int
    seq_len: int
    chunk_tokens: int  # our backend's lm_head chunk
    micro_tokens: int = 0  # our backend's tokens per micro-batch; 0 = the whole batch at once
    plain_checkpointing: bool = False  # the plain loop with HF activation checkpointing (4B: OOM without)


@dataclass
class Result:
    mode: str
    variant: str
    tokens_per_s: float
    peak_gib: float
    losses: list[float]
    tps_ratio: float = float("nan")
    mem_ratio: float = float("nan")
    mfu: float = float("nan")


def training_flops_per_token(shape: dict, seq_len: int) -> float:
    """6N + causal attention: N = the matmul weights (every layer's q/k/v/o and gate/up/down, and the
    lm_head; the embedding lookup does no matmul), 2 FLOPs per weight forward and 4 backward; attention
    adds QK^T and AV, 4 * seq_len * (heads x head_dim) FLOPs per token and layer forward, halved by the
    causal mask, x3 with backward. The same model FLOPs count for LoRA (its base backward skips the
    weight gradients, so its MFU by this count understates nothing it does not do)."""
    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, layers = shape["head_dim"], shape["num_hidden_layers"]
    attn_width = heads * head_dim
    per_layer = hidden * (attn_width + 2 * kv * head_dim) + attn_width * hidden
    per_layer += 3 * hidden * shape["intermediate_size"]
    matmul_weights = layers * per_layer + hidden * shape["vocab_size"]
    attention = 3 * layers * (4 * seq_len * attn_width / 2)
    return 6 * matmul_weights + attention


def write_model(path: Path, shape: dict, setup: Setup) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(setup.device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(setup.dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    del model


def make_batch(vocab: int, setup: Setup) -> list[Datum]:
    rng = np.random.default_rng(1)
    data = []
    for _ in range(setup.batch):
        tokens = rng.integers(0, vocab, setup.seq_len + 1).astype(np.int64)
        weights = np.ones(setup.seq_len, dtype=np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def plain_step_fn(model_dir: Path, mode: str, data: list[Datum], setup: Setup) -> Callable[[], float]:
    """The baseline loop; returns a step function giving the summed loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=setup.dtype).to(setup.device).eval()
    if setup.plain_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if mode == "lora":
        config = LoraConfig(r=LORA_RANK, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
        torch.manual_seed(0)  # the adapter init our backend uses for LoraSpec(seed=0)
        model = get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = setup.device == "cuda"
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, fused=fused)
    ids = torch.as_tensor(np.stack([d.model_input for d in data]), device=setup.device)
    targets = np.stack([d.loss_fn_inputs["target_tokens"] for d in data])
    targets = torch.as_tensor(targets, device=setup.device)

    def step() -> float:
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def ours_step_fn(
    model_dir: Path, mode: str, data: list[Datum], setup: Setup, compiled: bool
) -> Callable[[], float]:
    backend = TransformersBackend(
        str(model_dir),
        train_mode=mode,
        device=setup.device,
        dtype=setup.dtype,
        max_tokens_per_micro_batch=setup.micro_tokens or setup.batch * setup.seq_len,
        logprob_chunk_tokens=setup.chunk_tokens,
        compile_layers=compiled,
    )
    key = "bench"
    if mode == "lora":
        backend.create_adapter(key, LoraSpec(rank=LORA_RANK, alpha=32.0, seed=0, train_unembed=False))
    adam = AdamParams(learning_rate=LR)

    def step() -> float:
        out = backend.forward_backward(key, data, "cross_entropy", {})
        backend.optim_step(key, adam)
        return out.metrics["loss:sum"]

    return step


def megatron_step_fn(model_dir: Path, data: list[Datum], setup: Setup) -> Callable[[], float]:
    """The megatron backend (full fine-tuning, TP 1, one rank), stepped exactly as `ours`."""
    if setup.device == "cpu":
        from tools.megatron_cpu_check import redirect_cuda_to_cpu

        redirect_cuda_to_cpu()
    from miles.train.backends.megatron_backend import MegatronBackend

    backend = MegatronBackend(
        str(model_dir),
        train_mode="full",
        device=setup.device,
        dtype=setup.dtype,
        max_tokens_per_micro_batch=setup.micro_tokens or setup.batch * setup.seq_len,
    )
    adam = AdamParams(learning_rate=LR)

    def step() -> float:
        out = backend.forward_backward("full", data, "cross_entropy", {})
        backend.optim_step("full", adam)
        return out.metrics["loss:sum"]

    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    mode: str,
    variant: str,
    model_dir: Path,
    data: list[Datum],
    setup: Setup,
    warmup: int,
    steps: int,
    profile: bool = False,
) -> Result:
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if variant == "plain":
        step = plain_step_fn(model_dir, mode, data, setup)
    elif variant == "megatron":
        step = megatron_step_fn(model_dir, data, setup)
    else:
        step = ours_step_fn(model_dir, mode, data, setup, compiled=variant == "ours_compiled")
    losses = [step() for _ in range(warmup)]
    _sync(setup.device)
    start = time.perf_counter()
    losses += [step() for _ in range(steps)]
    _sync(setup.device)
    elapsed = time.perf_counter() - start
    if profile and setup.device == "cuda":
        print_top_kernels(step, f"{mode} {variant}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device == "cuda" else float("nan")
    del step
    gc.collect()
    if variant == "ours_compiled":
        torch._dynamo.reset()
    return Result(mode, variant, setup.batch * setup.seq_len * steps / elapsed, peak, losses)


def print_top_kernels(step: Callable[[], float], label: str, top: int = 12) -> None:
    """One profiled step: the CUDA kernels that took the most device time (to stderr)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    print(f"# top kernels, {label}: {total / 1e3:.1f} ms device time in one step", file=sys.stderr)
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        share = e.self_device_time_total / total
        print(f"#   {share:6.1%} {e.self_device_time_total / 1e3:8.1f} ms  {e.key[:90]}", file=sys.stderr)
    sys.stderr.flush()


def add_ratios(results: list[Result], flops_per_token: float) -> None:
    for result in results:
        result.mfu = result.tokens_per_s * flops_per_token / H200_DENSE_BF16_FLOPS
        base = next((r for r in results if r.mode == result.mode and r.variant == "plain"), None)
        if base is not None:
            result.tps_ratio = result.tokens_per_s / base.tokens_per_s
            result.mem_ratio = result.peak_gib / base.peak_gib  # nan on CPU


def table(results: list[Result]) -> str:
    lines = [
        "| mode | variant | tokens/s | x plain | peak GiB | x plain | MFU | loss step 1 | loss last |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.variant} | {r.tokens_per_s:,.0f} | {r.tps_ratio:.2f} | {r.peak_gib:.1f} | "
            f"{r.mem_ratio:.2f} | {r.mfu:.1%} | {r.losses[0]:.6g} | {r.losses[-1]:.6g} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny config on CPU, fp32, in seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--variants", default=None, help=f"comma list of {VARIANTS}")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--micro-tokens", type=int, default=0, help="ours: tokens per micro-batch")
    parser.add_argument("--plain-checkpointing", action="store_true", help="plain loop: HF checkpointing")
    parser.add_argument("--profile", action="store_true", help="top CUDA kernels of one step, each variant")
    parser.add_argument(
        "--backend",
        choices=("transformers", "megatron"),
        default="transformers",
        help="megatron: add the megatron backend's variant (full mode; default variants plain,ours,megatron)",
    )
    args = parser.parse_args(argv)
    if args.backend == "megatron":
        args.modes = "full" if args.modes == "full,lora" else args.modes
        args.variants = args.variants or "plain,ours,megatron"
    if args.variants and "megatron" in args.variants.split(",") and "lora" in args.modes.split(","):
        parser.error("the megatron variant trains the full model: use --modes full")
    for name in ("modes", "variants"):
        value = getattr(args, name)
        allowed = ("full", "lora") if name == "modes" else VARIANTS
        if value is not None and not set(value.split(",")) <= set(allowed):
            parser.error(f"--{name} takes a comma list of {allowed}, got {value!r}")
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    if args.small:
        setup = Setup("cpu", torch.float32, args.batch or 2, args.seq_len or 24, args.chunk_tokens or 7)
        shape, variants, steps, warmup = TINY, ("plain", "ours"), args.steps or 2, args.warmup or 1
    else:
        if not torch.cuda.is_available():
            sys.exit("the full bench needs CUDA; use --small on CPU")
        setup = Setup(
            "cuda",
            torch.bfloat16,
            args.batch or 8,
            args.seq_len or 2048,
            args.chunk_tokens or 2048,
            args.micro_tokens,
            args.plain_checkpointing,
        )
        shape, steps, warmup = SHAPES[args.shape], args.steps or 10, args.warmup or 3
        variants = VARIANTS[:3]
    variants = tuple(args.variants.split(",")) if args.variants else variants
    data = make_batch(shape["vocab_size"], setup)
    results = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-model-") as tmp:
        write_model(Path(tmp), shape, setup)
        for mode in args.modes.split(","):
            for variant in variants:
                results.append(measure(mode, variant, Path(tmp), data, setup, warmup, steps, args.profile))
                done = results[-1]
                print(f"# {mode} {variant}: {done.tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)
    # MFU against the H200's peak: meaningless on the CPU
    flops = training_flops_per_token(shape, setup.seq_len) if setup.device == "cuda" else float("nan")
    print(f"# model FLOPs per token (6N + causal attention): {flops:.4g}", file=sys.stderr, flush=True)
    add_ratios(results, flops)
    if args.json:
        described = {**asdict(setup), "dtype": str(setup.dtype)}
        print(json.dumps({"setup": described, "results": [asdict(r) for r in results]}))
    else:
        print(table(results))
    return results


if __name__ == "__main__":
    main()
