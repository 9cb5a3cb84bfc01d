"""Data-parallel training: N trainer ranks (one per GPU, NCCL) vs one rank, measured side by side in one run;
and the check that a data-parallel step equals one rank's step on the same data.

    python3 bench/train_dp.py [--json] [--ranks 2] [--batch 8] [--seq-len 2048] [--steps 10] [--warmup 3]
    python bench/train_dp.py --small      # tiny model, float32, CPU, gloo: the same code path, in seconds

Each rank is a process that joins the default torch.distributed group the way a trainer rank does (nccl on
CUDA, gloo on CPU; miles.train.worker) and runs TransformersBackend with a DistContext (miles.train.dist):
every rank gets the whole batch and runs its contiguous share; optim_step sums the gradients over ranks.
Phases, in the same processes, from the same model directory:
  check   one cross_entropy step + AdamW on `2 x ranks` datums, first by rank 0 alone (no DistContext),
          then by all ranks data parallel (eager layers). Rank 0 compares the gradients the optimizer steps
          with (an optimizer step pre-hook copies them) and the parameter updates.
  single  rank 0 alone, `--batch` sequences per step (the other ranks wait): tokens/s.
  dp      every rank, `--batch` sequences each per step (the global batch is ranks x batch): tokens/s.
The speed-up is dp tokens/s over single tokens/s; the layers are compiled on CUDA (the backend's default).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines forbid NVLink multicast

import torch
import torch.distributed as torch_dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from train_throughput import QWEN3_0_6B, TINY, Setup, make_batch, write_model  # noqa: E402

from miles.engines.weight_group import pick_master_port  # noqa: E402
from miles.train.backends.transformers_backend import TransformersBackend  # noqa: E402
from miles.train.dist import DistContext  # noqa: E402
from miles.types import AdamParams, Datum  # noqa: E402

CHECK_LR = 1e-3  # one step must move bf16 weights by more than their rounding for the update check to bite


@dataclass(frozen=True)
class Config:
    ranks: int
    device: str  # "cuda" or "cpu"
    dtype: str
    batch: int  # sequences per rank per step
    seq_len: int
    check_seq_len: int
    warmup: int
    steps: int
    lr: float
    chunk_tokens: int


@dataclass
class CheckResult:
    """Data parallel vs one rank after one step; relative errors are ||a - b|| / ||b|| per tensor, max'ed."""

    tensors: int
    grad_rel_max: float  # the gradients the optimizer stepped with (summed over ranks, before clipping)
    update_rel_max: float  # (param after - param before) of each run
    param_abs_max: float  # largest |param_dp - param_single| after the step
    grad_norm_single: float
    grad_norm_dp: float
    loss_single: float
    loss_dp: float
    logprob_abs_max: float


@dataclass
class Throughput:
    ranks: int
    tokens_per_step: int
    tokens_per_s: float
    peak_gib: float  # rank 0's torch.cuda.max_memory_allocated (nan on CPU)
    losses: list[float] = field(default_factory=list)


@dataclass
class Report:
    config: Config
    check: CheckResult | None
    single: Throughput | None
    dp: Throughput | None
    speedup: float = float("nan")


# ----- one rank ---------------------------------------------------------------------------------------------


def _join(rank: int, config: Config, port: int) -> torch.device:
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if config.device == "cuda" else "gloo"
    torch_dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.ranks,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    return torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")


def _backend(model_dir: str, config: Config, device: torch.device, dist: DistContext | None, compiled: bool):
    return TransformersBackend(
        model_dir,
        train_mode="full",
        device=str(device),
        dtype=getattr(torch, config.dtype),
        dist=dist,
        max_tokens_per_micro_batch=config.batch * config.seq_len,
        logprob_chunk_tokens=config.chunk_tokens,
        compile_layers=compiled,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class _StepCapture:
    """Copies (to CPU, fp32) the gradients every optimizer steps with, via torch's global pre-step hook."""

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}
        self._handle = register_optimizer_step_pre_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.grads[id(param)] = param.grad.detach().float().cpu()

    def remove(self) -> None:
        self._handle.remove()


def _one_step(backend: TransformersBackend, batch: list[Datum]) -> dict[str, Any]:
    """Params before/after, the stepped gradients and the step's outputs, all on CPU in fp32."""
    named = backend.named_trainable_parameters("full")
    before = {n: p.detach().float().cpu() for n, p in named}
    capture = _StepCapture()
    try:
        out = backend.forward_backward("full", batch, "cross_entropy", {})
        stepped = backend.optim_step("full", AdamParams(learning_rate=CHECK_LR))
    finally:
        capture.remove()
    return {
        "before": before,
        "after": {n: p.detach().float().cpu() for n, p in named},
        "grads": {n: capture.grads[id(p)] for n, p in named},
        "grad_norm": stepped["grad_norm:mean"],
        "loss": out.metrics["loss:sum"],
        "logprobs": out.logprobs,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(single: dict[str, Any], dp: dict[str, Any]) -> CheckResult:
    names = list(single["grads"])
    updates = {n: (single["after"][n] - single["before"][n], dp["after"][n] - dp["before"][n]) for n in names}
    logprob_diff = max(
        float(abs(a - b).max()) for a, b in zip(single["logprobs"], dp["logprobs"], strict=True)
    )
    return CheckResult(
        tensors=len(names),
        grad_rel_max=max(_rel(dp["grads"][n], single["grads"][n]) for n in names),
        update_rel_max=max(_rel(updates[n][1], updates[n][0]) for n in names),
        param_abs_max=max(float((dp["after"][n] - single["after"][n]).abs().max()) for n in names),
        grad_norm_single=single["grad_norm"],
        grad_norm_dp=dp["grad_norm"],
        loss_single=single["loss"],
        loss_dp=dp["loss"],
        logprob_abs_max=logprob_diff,
    )


def check_phase(rank: int, model_dir: str, config: Config, device: torch.device) -> CheckResult | None:
    batch = make_batch(
        _vocab(model_dir), Setup(config.device, torch.float32, 2 * config.ranks, config.check_seq_len, 0)
    )
    single = None
    if rank == 0:
        backend = _backend(model_dir, config, device, None, compiled=False)
        single = _one_step(backend, batch)
        del backend
        _release(device)
    torch_dist.barrier()
    backend = _backend(model_dir, config, device, DistContext(rank, config.ranks), compiled=False)
    dp = _one_step(backend, batch)
    del backend
    _release(device)
    return _compare(single, dp) if single is not None else None


def _vocab(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def throughput_phase(
    model_dir: str, config: Config, device: torch.device, dist: DistContext | None
) -> Throughput:
    ranks = dist.world_size if dist is not None else 1
    setup = Setup(config.device, torch.float32, ranks * config.batch, config.seq_len, 0)
    batch = make_batch(_vocab(model_dir), setup)  # every rank gets the whole batch and takes its share
    backend = _backend(model_dir, config, device, dist, compiled=device.type == "cuda")
    losses, elapsed = _timed_steps(backend, batch, config, device, dist)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del backend
    _release(device)
    tokens = ranks * config.batch * config.seq_len
    return Throughput(ranks, tokens, tokens * config.steps / elapsed, peak, losses)


def _timed_steps(
    backend: TransformersBackend, batch: list[Datum], config: Config, device: torch.device, dist
) -> tuple[list[float], float]:
    """Warm-up steps (compiles), then timed steps; (every step's loss, seconds of the timed ones)."""
    adam = AdamParams(learning_rate=config.lr)

    def step() -> float:
        out = backend.forward_backward("full", batch, "cross_entropy", {})
        backend.optim_step("full", adam)
        return out.metrics["loss:sum"]

    losses = [step() for _ in range(config.warmup)]
    _sync(device)
    if dist is not None:
        torch_dist.barrier()
    start = time.perf_counter()
    losses += [step() for _ in range(config.steps)]
    _sync(device)
    return losses, time.perf_counter() - start


def rank_main(rank: int, model_dir: str, config: Config, port: int, phases: list[str], results: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * config.ranks)))
    try:
        device = _join(rank, config, port)
        out: dict[str, Any] = {}
        if "check" in phases:
            out["check"] = check_phase(rank, model_dir, config, device)
        if "single" in phases:
            if rank == 0:
                out["single"] = throughput_phase(model_dir, config, device, None)
            torch_dist.barrier()
        if "dp" in phases:
            out["dp"] = throughput_phase(model_dir, config, device, DistContext(rank, config.ranks))
        torch_dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# ----- the run ----------------------------------------------------------------------------------------------


def run_ranks(model_dir: Path, config: Config, phases: list[str], timeout_s: float = 1800) -> dict[str, Any]:
    """Start one process per rank, wait for all; rank 0's results (any rank's error is raised)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    procs = [
        ctx.Process(target=rank_main, args=(r, str(model_dir), config, port, phases, results))
        for r in range(config.ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        answers = [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {r}: {value}" for r, status, value in answers if status != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return next(value for r, _, value in answers if r == 0)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny model, float32, CPU, gloo")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--check-seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--phases", default="check,single,dp")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    if not set(phases) <= {"check", "single", "dp"}:
        parser.error(f"--phases takes a comma list of check, single, dp; got {args.phases!r}")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (data parallel)")
    small = args.small
    config = Config(
        ranks=args.ranks,
        device="cpu" if small else "cuda",
        dtype=args.dtype or ("float32" if small else "bfloat16"),
        batch=args.batch or (2 if small else 8),
        seq_len=args.seq_len or (24 if small else 2048),
        check_seq_len=args.check_seq_len or (16 if small else 512),
        warmup=args.warmup if args.warmup is not None else (1 if small else 3),
        steps=args.steps or (2 if small else 10),
        lr=1e-5,
        chunk_tokens=7 if small else 2048,
    )
    args.phases = phases
    return args, config


def table(report: Report) -> str:
    lines = [f"config: {asdict(report.config)}"]
    if report.check is not None:
        lines.append(f"check (dp vs one rank, one step): {asdict(report.check)}")
    lines += ["| run | ranks | tokens/step | tokens/s | peak GiB rank 0 | loss first | loss last |"]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, t in (("single", report.single), ("dp", report.dp)):
        if t is not None:
            lines.append(
                f"| {name} | {t.ranks} | {t.tokens_per_step} | {t.tokens_per_s:,.0f} | {t.peak_gib:.1f} | "
                f"{t.losses[0]:.6g} | {t.losses[-1]:.6g} |"
            )
    lines.append(f"speed-up dp / single: {report.speedup:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Report:
    args, config = parse_args(argv)
    if config.device == "cuda" and torch.cuda.device_count() < config.ranks:
        sys.exit(f"{config.ranks} ranks need {config.ranks} CUDA devices; use --small on CPU")
    shape = TINY if args.small else QWEN3_0_6B
    with tempfile.TemporaryDirectory(prefix="miles-dp-model-") as tmp:
        write_model(Path(tmp), shape, Setup("cpu", getattr(torch, config.dtype), 1, 1, 0))
        out = run_ranks(Path(tmp), config, args.phases)
    report = Report(config, out.get("check"), out.get("single"), out.get("dp"))
    if report.single is not None and report.dp is not None:
        report.speedup = report.dp.tokens_per_s / report.single.tokens_per_s
    print(table(report), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(asdict(report)), flush=True)
    return report


if __name__ == "__main__":
    main()
