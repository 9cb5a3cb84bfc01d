"""Several LoRA tenants on one base: one batched pass (forward_backward_many) vs the same work one tenant
after another (forward_backward per tenant), on one TransformersBackend, side by side in one run.

    python bench/multi_tenant.py            # Qwen3-0.6B shape, bf16, CUDA: 4 tenants x 2 x 2048 tokens
    python bench/multi_tenant.py --small    # tiny config on CPU (CI-sized: shows the mechanism works)
    ... [--json] [--tenants 4] [--batch 2] [--seq-len 2048] [--rounds 8] [--steps 2] [--warmup 2]
        [--compile auto|on|off]
        [--profile]   # CUDA: top kernels of one batched and one one-adapter forward_backward (to stderr)

The modes are interleaved: each of `--rounds` rounds times `--steps` steps of sequential, then batched,
then one adapter, so drift in the machine (clocks, a neighbour's load) hits every mode alike. Each round
gives its own batched/sequential ratio; the summary is the median ratio over the rounds with its min-max,
and each mode's median tokens/s. `--warmup` steps of each mode run before the first round (compilation).

One step = every tenant's forward_backward, then every tenant's optim_step: sequential sends one optim_step
per tenant, batched one OptimStepMany (what the coalescer sends for steps waiting at once). Each row also
reports the two phases' seconds (`fb_s`, `optim_s`, with a device sync between them). A third row,
`one adapter`, runs the same number of tokens as one request of one tenant (cross_entropy): what the
mixed pass would take if all rows shared one adapter, its ceiling. Tenants
differ in data, LoRA rank and loss (cross_entropy / importance_sampling alternate). Before timing, one
forward-only round compares each tenant's logprobs between the modes (max |difference|).

The batching window (runtime.lora_batch_window_ms): the coalescer waits at most that long for companions,
and not at all once every loaded model has a request waiting. What it costs is the window against one
tenant's pass (printed as `window_cost`); the round trip it hides is the gap between tenants' requests.
The window row runs 4 concurrent submits through ForwardBackwardCoalescer on the in-process trainer with
the window on (but no early start: `models` unknown, so every round waits the full window) against off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train_throughput as tt  # noqa: E402

from miles.train.backends.transformers_backend import TransformersBackend  # noqa: E402
from miles.train.coalescer import DEFAULT_WINDOW_S, ForwardBackwardCoalescer, OptimStepMany  # noqa: E402
from miles.train.commands import ForwardBackward, OptimStep  # noqa: E402
from miles.train.in_process import InProcessTrainer  # noqa: E402
from miles.types import AdamParams, Datum, LoraSpec  # noqa: E402

RANKS = (32, 16, 64, 8)
ADAM = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-12)


@dataclass
class Row:
    mode: str
    tokens_per_s: float
    step_s: float
    peak_gib: float
    fb_s: float = float("nan")
    optim_s: float = float("nan")
    ratio: float = float("nan")


def tenant_batch(vocab: int, batch: int, seq_len: int, seed: int, loss_fn: str) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(batch):
        tokens = rng.integers(0, vocab, seq_len + 1).astype(np.int64)
        inputs: dict[str, np.ndarray] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = np.ones(seq_len, dtype=np.float32)
        else:
            inputs["logprobs"] = np.full(seq_len, -np.log(vocab), dtype=np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, seq_len).astype(np.float32)
        data.append(Datum(tokens[:-1], inputs))
    return data


def requests(vocab: int, args: argparse.Namespace, forward_only: bool = False) -> list[ForwardBackward]:
    out = []
    for index in range(args.tenants):
        loss = "cross_entropy" if index % 2 == 0 else "importance_sampling"
        data = tenant_batch(vocab, args.batch, args.seq_len, seed=index, loss_fn=loss)
        out.append(ForwardBackward(f"tenant-{index}", data, loss, {}, forward_only))
    return out


def one_adapter_request(vocab: int, args: argparse.Namespace) -> ForwardBackward:
    """All tenants' token count as one cross_entropy request of tenant 0."""
    data = tenant_batch(vocab, args.tenants * args.batch, args.seq_len, seed=0, loss_fn="cross_entropy")
    return ForwardBackward("tenant-0", data, "cross_entropy", {})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sequential_step(backend: TransformersBackend, work: list[ForwardBackward], device: str) -> float:
    """The step; returns the seconds its forward_backward phase took."""
    start = time.perf_counter()
    for request in work:
        request.run(backend)
    sync(device)
    fb_s = time.perf_counter() - start
    for request in work:
        backend.optim_step(request.key, ADAM)
    return fb_s


def batched_step(backend: TransformersBackend, work: list[ForwardBackward], device: str) -> float:
    start = time.perf_counter()
    outcomes = backend.forward_backward_many(work)
    sync(device)
    fb_s = time.perf_counter() - start
    outcomes += OptimStepMany(tuple(OptimStep(request.key, ADAM) for request in work)).run(backend)
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    return fb_s


MODES = ("sequential", "batched", "one adapter")


def timed(step, backend, work, args, device: str, mode: str) -> Row:
    """`args.steps` steps of one mode, one round's row (its own peak memory)."""
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fb_s = sum(step(backend, work, device) for _ in range(args.steps)) / args.steps
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.tenants * args.batch * args.seq_len
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return Row(mode, tokens / seconds, seconds, peak, fb_s, seconds - fb_s)


def interleaved_rounds(backend, work, one, args, device: str) -> list[dict[str, Row]]:
    """Warm-up of each mode, then `args.rounds` rounds of every mode in turn; per round, each mode's row
    with its ratio to that round's sequential row."""
    runs = {
        "sequential": (sequential_step, work),
        "batched": (batched_step, work),
        "one adapter": (sequential_step, one),
    }
    for step, requests in runs.values():
        for _ in range(args.warmup):
            step(backend, requests, device)
    rounds = []
    for index in range(args.rounds):
        rows = {}
        for mode in MODES:
            step, requests = runs[mode]
            rows[mode] = timed(step, backend, requests, args, device, mode)
        for row in rows.values():
            row.ratio = row.tokens_per_s / rows["sequential"].tokens_per_s
        line = {mode: (round(row.tokens_per_s), round(row.ratio, 3)) for mode, row in rows.items()}
        print(f"# round {index + 1} (tokens/s, vs sequential): {line}", file=sys.stderr, flush=True)
        rounds.append(rows)
    return rounds


def summary(rounds: list[dict[str, Row]]) -> dict[str, dict[str, float]]:
    """Per mode: median tokens/s (min-max), median seconds per step and phase, the highest peak, and the
    median ratio to sequential over the rounds (min-max)."""
    out = {}
    for mode in MODES:
        rows = [r[mode] for r in rounds]
        speeds, ratios = [r.tokens_per_s for r in rows], [r.ratio for r in rows]
        out[mode] = {
            "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds),
            "step_s": statistics.median(r.step_s for r in rows),
            "fb_s": statistics.median(r.fb_s for r in rows),
            "optim_s": statistics.median(r.optim_s for r in rows),
            "peak_gib": max(r.peak_gib for r in rows),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def max_logprob_difference(backend: TransformersBackend, vocab: int, args: argparse.Namespace) -> float:
    work = requests(vocab, args, forward_only=True)
    alone = [request.run(backend) for request in work]
    together = backend.forward_backward_many(work)
    return max(
        float(np.abs(a - b).max())
        for one, many in zip(alone, together, strict=True)
        for a, b in zip(one.logprobs, many.logprobs, strict=True)
    )


def timed_once(request: ForwardBackward, backend: TransformersBackend, device: str) -> float:
    """Seconds of one run of `request` after a warm-up run."""
    request.run(backend)
    sync(device)
    start = time.perf_counter()
    request.run(backend)
    sync(device)
    return time.perf_counter() - start


def window_rows(backend: TransformersBackend, vocab: int, args: argparse.Namespace, device: str) -> dict:
    """One tenant's pass time, and rounds of concurrent submits through the coalescer, window off vs on."""
    single = requests(vocab, args, forward_only=True)[0]
    one_pass_s = timed_once(single, backend, device)
    train = requests(vocab, args)[0]
    one_train_pass_s = timed_once(train, backend, device)
    backend.reset(train.key)  # drop the pass's gradients (and the adapter's training: the check is done)
    trainer = InProcessTrainer(backend)

    async def rounds(window_s: float) -> float:
        coalescer = ForwardBackwardCoalescer(trainer.run, window_s=window_s)
        work = requests(vocab, args, forward_only=True)
        await asyncio.gather(*(coalescer.submit(r) for r in work))  # warm-up
        start = time.perf_counter()
        for _ in range(args.steps):
            await asyncio.gather(*(coalescer.submit(r) for r in work))
        sync(device)
        return (time.perf_counter() - start) / args.steps

    off, on = asyncio.run(rounds(0.0)), asyncio.run(rounds(args.window_ms / 1000))
    return {
        "one_tenant_forward_s": one_pass_s,
        "one_tenant_forward_backward_s": one_train_pass_s,
        "window_ms": args.window_ms,
        "window_cost": args.window_ms / 1000 / one_pass_s,
        "window_cost_training": args.window_ms / 1000 / one_train_pass_s,
        "forward_round_window_off_s": off,
        "forward_round_window_on_s": on,
        "forward_round_speedup": off / on,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model on CPU, fp32")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="datums per tenant (2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per datum (2048; --small: 64)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds of every mode")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each mode before the first round")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--window-ms", type=float, default=DEFAULT_WINDOW_S * 1000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true", help="CUDA: top kernels of one pass, to stderr")
    args = parser.parse_args()
    args.batch = args.batch or 2
    args.seq_len = args.seq_len or (64 if args.small else 2048)
    if not 1 <= args.tenants <= len(RANKS) * 4:
        parser.error(f"--tenants must be between 1 and {len(RANKS) * 4}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1 and --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    # LoRA routes are tensors, so the modes share a few graphs whatever the tenants (printed as
    # dynamo_graphs; compile_decoder_layers sets the recompile limit)
    device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape = tt.TINY if args.small else tt.QWEN3_0_6B
    setup = tt.Setup(device, dtype, args.batch, args.seq_len, chunk_tokens=2048)
    compile_layers = None if args.compile == "auto" else args.compile == "on"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        tt.write_model(model_dir, shape, setup)
        backend = TransformersBackend(
            str(model_dir),
            train_mode="lora",
            device=device,
            dtype=dtype,
            max_tokens_per_micro_batch=args.tenants * args.batch * args.seq_len,
            compile_layers=compile_layers,
        )
        for index in range(args.tenants):
            rank = RANKS[index % len(RANKS)]
            backend.create_adapter(f"tenant-{index}", LoraSpec(rank=rank, alpha=32.0, seed=index))
        vocab = shape["vocab_size"]
        work = requests(vocab, args)
        one = [one_adapter_request(vocab, args)]
        rounds = interleaved_rounds(backend, work, one, args, device)
        difference = max_logprob_difference(backend, vocab, args)  # trained adapters: B is no longer 0
        window = window_rows(backend, vocab, args, device)
        if args.profile and device == "cuda":  # last: its passes leave gradients pending
            tt.print_top_kernels(lambda: backend.forward_backward_many(work), "batched forward_backward", 16)
            tt.print_top_kernels(lambda: one[0].run(backend), "one adapter forward_backward", 16)
    modes = summary(rounds)
    report = {
        "setup": {
            "device": device if device == "cpu" else torch.cuda.get_device_name(),
            "dtype": str(dtype),
            "shape": "tiny" if args.small else "qwen3-0.6b",
            "tenants": args.tenants,
            "ranks": [RANKS[i % len(RANKS)] for i in range(args.tenants)],
            "batch": args.batch,
            "seq_len": args.seq_len,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "compile_layers": backend.compile_layers,
            "torch": torch.__version__,
            "max_logprob_difference": difference,
            "dynamo_graphs": dict(torch._dynamo.utils.counters["stats"]),  # recompiles show here
        },
        "rounds": [{mode: asdict(row) for mode, row in r.items()} for r in rounds],
        "modes": modes,
        "window": window,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(report["setup"])
    print_report(rounds, modes, window)


def print_report(rounds: list[dict[str, Row]], modes: dict[str, dict[str, float]], window: dict) -> None:
    print("| round | sequential tokens/s | batched tokens/s | one adapter tokens/s | batched / sequential |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for index, rows in enumerate(rounds, 1):
        speeds = " | ".join(f"{rows[mode].tokens_per_s:,.0f}" for mode in MODES)
        print(f"| {index} | {speeds} | {rows['batched'].ratio:.3f}x |")
    print()
    print(
        "| mode (medians over rounds) | tokens/s (min-max) | step s | forward_backward s | optim_step s |"
        " peak GiB | vs sequential (min-max) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, m in modes.items():
        cells = f"{m['tokens_per_s']:,.0f} ({m['tokens_per_s_min']:,.0f}-{m['tokens_per_s_max']:,.0f}) | "
        cells += f"{m['step_s']:.4f} | {m['fb_s']:.4f} | {m['optim_s']:.4f} | {m['peak_gib']:.1f} | "
        cells += f"{m['ratio']:.3f}x ({m['ratio_min']:.3f}-{m['ratio_max']:.3f})"
        print(f"| {mode} | {cells} |")
    batched = modes["batched"]
    print(
        f"median batched/sequential: {batched['ratio']:.3f}x "
        f"(min {batched['ratio_min']:.3f}x, max {batched['ratio_max']:.3f}x over {len(rounds)} rounds)"
    )
    print("window:", {k: round(v, 5) if isinstance(v, float) else v for k, v in window.items()})


if __name__ == "__main__":
    main()
