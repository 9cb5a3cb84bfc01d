"""The RL loop's plain single-process baseline, and what it shares with `bench/rl_loop.py`.

    python bench/rl_baseline.py --config '{"groups": 2, ...}' (--model-dir DIR | --preset P [--set K=V ...])
        --out result.json

`bench/rl_loop.py` runs this as its own process once the job is cancelled, so the baseline has the device
alone. One process, no service: the model loaded with transformers (bf16 on CUDA, fp32 on CPU), HF
`model.generate` for all G x N samples at once (G*N rows: each of the G prompts N times; do_sample,
temperature 1, no top-k/top-p, exactly T new tokens, the raw logits kept for the sampler's logprobs), then
the plain training step: one forward + backward over the same rows with the same per-token loss
(`importance_sampling`: -exp(lp - lp_sampler) * A; `ppo`: the clipped surrogate), summed as Tinker sums
it, and a torch AdamW step (Tinker's Adam defaults: betas 0.9/0.95, eps 1e-12, no weight decay; fused on
CUDA). The sampler is the trainer, so the weight sync costs nothing.

The shared pieces (the prompts, the reward, the advantages, kl_sample_train, the GPU-utilisation sampler,
the per-step row and its medians) live here so both sides compute them the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LOSSES = ("importance_sampling", "ppo")
PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker's documented defaults
ADAM_BETAS = (0.9, 0.95)  # tinker.types.AdamParams' defaults, so both sides take the same step
ADAM_EPS = 1e-12
PROMPT_ID_LOW = 16  # below: the tiny tokenizer's special tokens (ids 0-4) and some room


@dataclass(frozen=True)
class LoopConfig:
    """One GRPO-style loop, the same on both sides."""

    groups: int = 8
    samples: int = 8  # per group (per prompt)
    max_tokens: int = 128  # new tokens per sample; sampling never stops early (stop=[])
    steps: int = 5  # measured steps
    warmup: int = 1  # steps run first and left out of the medians
    prompt_len: int = 64
    loss: str = "importance_sampling"
    lr: float = 1e-6
    temperature: float = 1.0
    seed: int = 0  # the prompts' seed: the same prompts every run
    # every this many steps the step keeps a snapshot, as tinker-cookbook's save_every: the job saves with
    # a name (save_weights_for_sampler) and samples from its path; the plain loop writes save_pretrained
    save_every: int = 0

    def saves_at(self, step: int) -> bool:
        return self.save_every > 0 and (step + 1) % self.save_every == 0

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


# ---- what both sides compute the same way ---------------------------------------------------------------


def prompt_id_range(vocab: int) -> tuple[int, int]:
    """Prompt token ids are drawn from [16, vocab - vocab/100): clear of the tiny tokenizer's special ids at
    the bottom and of Qwen's (151643+ of 151936) at the top."""
    return PROMPT_ID_LOW, vocab - max(vocab // 100, 8)


def make_prompts(vocab: int, cfg: LoopConfig) -> list[list[int]]:
    """G fixed random prompts of exactly prompt_len token ids (seeded: the same every run)."""
    low, high = prompt_id_range(vocab)
    rng = np.random.default_rng(cfg.seed)
    return [rng.integers(low, high, cfg.prompt_len).tolist() for _ in range(cfg.groups)]


def reward(tokens: Sequence[int], vocab: int) -> float:
    """The synthetic reward: the fraction of sampled tokens in the lower half of the vocabulary."""
    if not tokens:
        return 0.0
    half = vocab // 2
    return sum(1 for t in tokens if t < half) / len(tokens)


def group_advantages(rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    """GRPO's group-centred advantages: each sample's reward less its group's mean (no std scaling)."""
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        out.append([r - mean for r in group])
    return out


def kl_sample_train(sampler: Sequence[np.ndarray], trainer: Sequence[np.ndarray]) -> tuple[float, float]:
    """tinker-cookbook's rl metrics over every sampled token: v1 = mean(lp_sampler - lp_trainer),
    v2 = mean((lp_sampler - lp_trainer)^2) / 2; the trainer's logprobs are forward_backward's (before the
    optimizer step)."""
    diffs = np.concatenate(
        [np.asarray(s, np.float64) - np.asarray(t, np.float64) for s, t in zip(sampler, trainer, strict=True)]
    )
    if diffs.size == 0:
        return float("nan"), float("nan")
    return float(diffs.mean()), float(0.5 * (diffs**2).mean())


@dataclass
class StepRow:
    """One step of the loop, as the client sees it."""

    step: int
    warmup: bool
    sample_s: float
    sampled_tokens: int
    sample_tps: float
    train_s: float  # forward_backward + optim_step
    train_tokens: int  # prompt + completion tokens of every datum
    train_tps: float
    # the weight sync as the client sees it (a named save on a saves_at step); 0 for the baseline, except
    # its save_pretrained on a saves_at step
    sync_ms: float
    push_ms: float | None  # the job's server-side push (miles_push_seconds), None where not exposed
    step_s: float
    gpu_idle_s: float | None  # fraction of utilisation samples at 0% x step_s; None without a GPU
    gpu_util_mean: float | None
    gpu_samples: int
    kl_v1: float
    kl_v2: float
    reward_mean: float
    loss_sum: float
    saved: bool = False  # a saves_at step: the save was a named, kept snapshot


SUMMARY_FIELDS = (
    "step_s",
    "sample_s",
    "sample_tps",
    "train_s",
    "train_tps",
    "push_ms",
    "gpu_idle_s",
    "gpu_util_mean",
    "kl_v1",
    "kl_v2",
    "reward_mean",
)


def summarize(rows: Sequence[StepRow]) -> dict[str, float | None]:
    """Medians over the measured (not warm-up) steps; None where a metric has no value."""
    measured = [r for r in rows if not r.warmup] or list(rows)
    out: dict[str, float | None] = {"steps": float(len(measured))}
    for name in SUMMARY_FIELDS:
        values = [getattr(r, name) for r in measured if getattr(r, name) is not None]
        out[name] = float(statistics.median(values)) if values else None
    # the weight sync: a step that keeps a snapshot (--save-every) apart from the others
    for key, saved in (("sync_ms", False), ("saved_sync_ms", True)):
        values = [r.sync_ms for r in measured if r.saved is saved]
        out[key] = float(statistics.median(values)) if values else None
    return out


def row_from_dict(data: dict[str, Any]) -> StepRow:
    names = {f.name for f in fields(StepRow)}
    return StepRow(**{k: v for k, v in data.items() if k in names})


# ---- GPU utilisation ----------------------------------------------------------------------------------


def _visible_gpu_ids() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices or UUIDs); None when unset (every GPU), [] when hidden."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    ids = [v.strip() for v in value.split(",") if v.strip()]
    return [] if any(v.startswith("-") for v in ids[:1]) else ids


class GpuSampler:
    """Device-wide GPU utilisation (`utilization.gpu`) every `interval_s`, in a background thread: NVML
    (nvidia-ml-py) where it loads, else `nvidia-smi -lms`. Each sample is the busiest visible GPU's
    percentage. `kind` is None where there is no GPU (then every window reports None)."""

    def __init__(self, interval_s: float = 0.1, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None
        self.kind: str | None = None
        self.names: list[str] = []
        self._handles: list[Any] = []
        self._smi_ids: list[str] | None = None
        ids = _visible_gpu_ids()
        if not enabled or ids == []:
            return
        if self._init_nvml(ids):
            self.kind = "nvml"
        elif shutil.which("nvidia-smi"):
            self.kind = "nvidia-smi"
            self._smi_ids = ids

    def _init_nvml(self, ids: list[str] | None) -> bool:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            if ids is None:
                handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            else:
                handles = [
                    pynvml.nvmlDeviceGetHandleByUUID(i) if not i.isdigit()
                    else pynvml.nvmlDeviceGetHandleByIndex(int(i))
                    for i in ids
                ]  # fmt: skip
            if not handles:
                return False
            self._handles = handles
            self.names = [str(pynvml.nvmlDeviceGetName(h)) for h in handles]
            self._nvml = pynvml
            return True
        except Exception:
            return False

    def start(self) -> GpuSampler:
        if self.kind == "nvml":
            self._thread = threading.Thread(target=self._nvml_loop, name="gpu-sampler", daemon=True)
        elif self.kind == "nvidia-smi":
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
            if self._smi_ids:
                cmd += ["-i", ",".join(self._smi_ids)]
            cmd += ["-lms", str(max(int(self.interval_s * 1000), 50))]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._smi_loop, name="gpu-sampler", daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def _add(self, value: float) -> None:
        with self._lock:
            self.samples.append((time.perf_counter(), value))

    def _nvml_loop(self) -> None:
        while not self._stop.is_set():
            try:
                util = max(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles)
                self._add(float(util))
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def _smi_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        per_tick = max(len(self._smi_ids or []), 1) if self._smi_ids else None
        block: list[float] = []
        for line in self._proc.stdout:
            try:
                block.append(float(line.strip()))
            except ValueError:
                continue
            if per_tick is None or len(block) >= per_tick:  # all GPUs: one line each, read as one sample
                self._add(max(block))
                block = []

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.kind == "nvml":
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def busy_processes(self) -> int:
        """How many processes hold a visible GPU (0 without a GPU or where it cannot be asked)."""
        try:
            if self.kind == "nvml":
                return sum(len(self._nvml.nvmlDeviceGetComputeRunningProcesses(h)) for h in self._handles)
            if self.kind == "nvidia-smi":
                cmd = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
                if self._smi_ids:
                    cmd += ["-i", ",".join(self._smi_ids)]
                text = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
                return sum(1 for line in text.splitlines() if line.strip())
        except Exception:
            return 0
        return 0

    def window(self, start: float, end: float) -> tuple[float | None, float | None, int]:
        """(idle fraction, mean utilisation %, samples) between two perf_counter times."""
        if self.kind is None:
            return None, None, 0
        with self._lock:
            values = [v for t, v in self.samples if start <= t <= end]
        if not values:
            return None, None, 0
        return sum(1 for v in values if v == 0) / len(values), sum(values) / len(values), len(values)


def idle_seconds(sampler: GpuSampler, start: float, end: float) -> tuple[float | None, float | None, int]:
    frac, mean, count = sampler.window(start, end)
    return (None if frac is None else frac * (end - start)), mean, count


# ---- the baseline ---------------------------------------------------------------------------------------


def resolve_model(
    model_dir: str | None, preset: str | None, overrides: Sequence[str], run_dir: str | None
) -> Path:
    """The model directory: given, or what the job's driver would serve for the preset, found the way
    `miles.driver.bringup.resolve_model_dir` finds it (that module is not imported: it pulls in Ray and the
    gateway): `init: tiny` builds `miles.models.tiny` with the preset's `init_shape` into RUN_DIR/model
    (kept if already there); otherwise `model.path`, a directory or a hub name in the HF cache."""
    if model_dir:
        return Path(model_dir)
    if not preset:
        raise SystemExit("the baseline needs --model-dir or --preset")
    from launcher.defaults import load_user_preset

    model = load_user_preset(preset, overrides).model
    if model.init == "tiny":
        from miles.models import tiny

        target = Path(run_dir or tempfile.mkdtemp(prefix="rl-baseline-")) / "model"
        if not (target / "config.json").is_file():
            shape = getattr(model, "init_shape", "tiny")
            spec = tiny.tiny_spec(shape) if hasattr(tiny, "tiny_spec") else None
            tiny.build_tiny_model(target, spec)
        return target.resolve()
    if not model.path:
        raise SystemExit("model.path is required unless model.init is 'tiny'")
    from miles.contract.model_source import resolve_model_path

    return Path(resolve_model_path(model.path).directory)


def _per_token_loss(lp: Any, old: Any, adv: Any, loss: str) -> Any:
    import torch

    ratio = torch.exp(lp - old)
    if loss == "ppo":
        low, high = PPO_CLIP["clip_low_threshold"], PPO_CLIP["clip_high_threshold"]
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    return -ratio * adv


def run_baseline(
    cfg: LoopConfig, model_dir: Path, on_step: Callable[[StepRow], None] | None = None
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    vocab = int(model.config.vocab_size)
    # exactly max_tokens new tokens, as the job's stop=[]: no EOS stopping
    model.generation_config.eos_token_id = None
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    optim = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=ADAM_BETAS,
        eps=ADAM_EPS,
        weight_decay=0.0,
        fused=cuda,
    )
    prompts = make_prompts(vocab, cfg)
    rows_prompts = torch.tensor([p for p in prompts for _ in range(cfg.samples)], device=device)
    n_rows, plen = rows_prompts.shape
    sampler = GpuSampler(enabled=cuda).start()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows: list[StepRow] = []
    torch.manual_seed(cfg.seed)
    saves = tempfile.TemporaryDirectory(prefix="rl-plain-saves-")  # the plain loop's kept snapshots
    save_root = Path(saves.name)
    try:
        for step in range(cfg.total_steps):
            sync()
            t0 = time.perf_counter()
            model.eval()
            with torch.no_grad():
                out = model.generate(
                    input_ids=rows_prompts,
                    attention_mask=torch.ones_like(rows_prompts),
                    do_sample=True,
                    temperature=cfg.temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=cfg.max_tokens,
                    pad_token_id=pad,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                completion = out.sequences[:, plen:]
                old_lp = torch.stack(
                    [
                        torch.log_softmax(logits.float(), -1).gather(-1, completion[:, t, None]).squeeze(-1)
                        for t, logits in enumerate(out.logits)
                    ],
                    dim=1,
                )
            sync()
            t1 = time.perf_counter()
            comp_list = completion.tolist()
            rewards = [
                [reward(comp_list[g * cfg.samples + i], vocab) for i in range(cfg.samples)]
                for g in range(cfg.groups)
            ]
            adv = torch.tensor(
                [a for group in group_advantages(rewards) for a in group], device=device, dtype=torch.float32
            )
            sequences = out.sequences
            del out
            sync()
            t2 = time.perf_counter()
            model.train()
            logits = model(input_ids=sequences[:, :-1]).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
            del logits
            lp_completion = lp[:, plen - 1 :]
            loss = _per_token_loss(lp_completion, old_lp, adv[:, None], cfg.loss).sum()
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            sync()
            t3 = time.perf_counter()
            if cfg.saves_at(step):  # what a plain loop does to keep a snapshot: write it, then go on
                model.save_pretrained(str(save_root / f"step-{step:04d}"), safe_serialization=True)
            t4 = time.perf_counter()
            kl_v1, kl_v2 = kl_sample_train(
                list(old_lp.float().cpu().numpy()), list(lp_completion.detach().float().cpu().numpy())
            )
            sampled = int(completion.numel())
            trained = int(n_rows * sequences.shape[1])
            idle, util, count = idle_seconds(sampler, t0, t4)
            row = StepRow(
                step=step,
                warmup=step < cfg.warmup,
                sample_s=t1 - t0,
                sampled_tokens=sampled,
                sample_tps=sampled / (t1 - t0),
                train_s=t3 - t2,
                train_tokens=trained,
                train_tps=trained / (t3 - t2),
                sync_ms=(t4 - t3) * 1000,
                push_ms=None,
                step_s=t4 - t0,
                gpu_idle_s=idle,
                gpu_util_mean=util,
                gpu_samples=count,
                kl_v1=kl_v1,
                kl_v2=kl_v2,
                reward_mean=float(np.mean([r for g in rewards for r in g])),
                loss_sum=float(loss.detach()),
                saved=cfg.saves_at(step),
            )
            del lp, lp_completion, loss, old_lp, sequences, completion
            rows.append(row)
            if on_step is not None:
                on_step(row)
    finally:
        sampler.stop()
        saves.cleanup()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model_dir": str(model_dir),
        "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "torch": torch.__version__,
        "rows": [asdict(r) for r in rows],
    }


@contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[StepRow], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(label, total=total)

        def advance(row: StepRow) -> None:
            progress.update(
                task,
                advance=1,
                description=f"{label}: step {row.step} {row.step_s:.2f} s, kl {row.kl_v1:+.2e}",
            )

        yield advance


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="{}", help="LoopConfig fields as JSON")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--preset", default=None, help="build/resolve the model as the job's driver does")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--run-dir", default=None, help="where a tiny/shape model is built (default: a temp dir)"
    )
    parser.add_argument("--out", required=True, help="write the result JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = LoopConfig(**json.loads(args.config))
    model_dir = resolve_model(args.model_dir, args.preset, args.overrides, args.run_dir)
    with _progress(cfg.total_steps, "plain") as advance:
        result = run_baseline(cfg, model_dir, advance)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
