"""An RL loop end to end through the whole job, against a plain single-process loop on the same device.

    python bench/rl_loop.py                              # qwen3-0.6b-shape-colocated, 8 x 8 x 128, 5 steps
    python bench/rl_loop.py --preset tiny-cpu --set model.train_mode=full \\
        --groups 2 --samples 2 --max-tokens 16 --steps 2  # the tiny model on a CPU box, in minutes
    ... [--loss importance_sampling|ppo] [--lr 1e-6] [--prompt-len 64] [--warmup 1] [--timeout 900]
        [--save-every N] [--skip-job] [--skip-baseline] [--model-dir DIR] [--json PATH]

The whole job: `launcher submit --scheduler local --preset P [--set K=V ...] --wait` (run as `python -m
launcher` with this interpreter, so the job's processes use it too), then through the real tinker SDK a
GRPO-style loop. Each step samples G groups x N samples (G fixed random prompts of --prompt-len token ids,
the same every run; exactly T new tokens: `stop=[]`; with logprobs) from the current sampling client, scores
each sample (the fraction of its tokens in the lower half of the vocabulary), takes group-centred
advantages, runs forward_backward (`importance_sampling`, or `ppo` with clip 0.8/1.2) on datums built the
tinker-cookbook way (model_input = prompt + completion less the last token; target_tokens, logprobs and
advantages per position, zero on the prompt), optim_step (Adam), then save_weights_and_get_sampling_client
for the next step; with --save-every N, every Nth step keeps a snapshot as tinker-cookbook's save_every does
(save_weights_for_sampler(name), then a sampling client on its path; the plain loop: save_pretrained), and
the summary gives those steps' sync apart ("named save ms"). The job is then cancelled and
`bench/rl_baseline.py` runs the same loop as one plain process on the same device (HF generate, one
forward/backward, torch AdamW; see its docstring).

Per step: sampling tokens/s (sampled tokens / sampling wall time), training tokens/s (prompt + completion
tokens / forward_backward + optim_step wall time), weight sync ms (save_weights_and_get_sampling_client as
the client sees it), the server's push time (`miles_push_seconds` on the gateway's /metrics, the pushes
that finished during the step: a colocated job pushes when it switches to sampling), step time, GPU idle
seconds (the fraction of 100 ms utilisation samples at 0%, times the step time; null without a GPU), and
kl_sample_train_v1/v2 as tinker-cookbook defines them (sampler logprob - trainer logprob over every sampled
token; the trainer's are forward_backward's, before the optimizer step). The summary gives the medians
over the measured steps (the warm-up steps are left out) and the ratios whole job / plain loop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.rl_baseline import (  # noqa: E402
    LOSSES,
    PPO_CLIP,
    GpuSampler,
    LoopConfig,
    StepRow,
    group_advantages,
    idle_seconds,
    kl_sample_train,
    make_prompts,
    reward,
    row_from_dict,
    summarize,
)

DEFAULT_PRESET = "qwen3-0.6b-shape-colocated"
LOG_TAIL_LINES = 40
# the step table is wide: no 80-column wrapping where the output goes to a file or a pipe
console = Console(stderr=True, width=None if sys.stderr.isatty() else 180)
out = Console(width=None if sys.stdout.isatty() else 180)


class BenchError(RuntimeError):
    """A failure the bench explains and exits on (exit status `code`)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ---- the job through the launcher -----------------------------------------------------------------------


def launcher(*args: str) -> list[str]:
    """`launcher ARGS` as `python -m launcher ARGS` with this interpreter: the job script runs its steps with
    the python that rendered it (and Ray from `ray` beside it), so the job uses this environment."""
    return [sys.executable, "-m", "launcher", *args]


@dataclass
class Job:
    run_id: str
    run_dir: Path
    url: str
    api_key: str
    bringup_s: float | None
    phases: list[dict[str, Any]] = field(default_factory=list)

    def preset(self) -> dict[str, Any]:
        import yaml

        return yaml.safe_load((self.run_dir / "preset.yaml").read_text())


def log_tail(run_id: str, lines: int = LOG_TAIL_LINES) -> str:
    proc = subprocess.run(
        launcher("logs", run_id, "--tail", str(lines)), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    return (proc.stdout + proc.stderr).rstrip()


def cancel(run_id: str, gpu: GpuSampler, wait_s: float = 90.0) -> str | None:
    """Cancel the job, then wait (up to wait_s) until it has ended and no process holds the GPU."""
    proc = subprocess.run(
        launcher("cancel", run_id, "--json"), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    state = None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = subprocess.run(
            launcher("status", run_id, "--json"), cwd=REPO, capture_output=True, text=True, timeout=60
        )
        try:
            state = json.loads(status.stdout).get("state")
        except json.JSONDecodeError:
            state = None
        if state not in ("RUNNING", "PENDING") and not gpu.busy_processes():
            break
        time.sleep(1.0)
    if proc.returncode != 0:
        console.print(f"[yellow]launcher cancel {run_id} said:[/] {(proc.stdout + proc.stderr).strip()}")
    return state


def submit(args: argparse.Namespace) -> tuple[Job | None, str | None, str]:
    """(the serving job, None, '') or (None, run id if one was made, why not)."""
    cmd = launcher("submit", "--scheduler", "local", "--preset", args.preset, "--wait", "--json")
    cmd += ["--timeout", str(args.timeout)]
    for override in args.overrides:
        cmd += ["--set", override]
    console.print(f"[bold]submit[/] {' '.join(cmd[1:])}")
    # the wait's step lines go to stderr (shown as they come), the JSON outcome to stdout
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return None, None, f"launcher submit exited {proc.returncode}: {proc.stdout.strip()}"
    run_id = data.get("run_id")
    wait = data.get("wait") or {}
    if proc.returncode != 0 or wait.get("outcome") != "serving":
        tail = "\n".join(wait.get("log_tail") or [])
        component = wait.get("failing_component")
        why = f"launcher exit {proc.returncode}, outcome {wait.get('outcome')!r}"
        why += f", failing component {component!r}" if component else ""
        return None, run_id, why + (f"\n{tail}" if tail else "")
    key_file = wait.get("api_key_file")
    if not wait.get("gateway_url") or not key_file:
        return None, run_id, f"the job serves but gave no gateway URL or key file: {wait}"
    steps = wait.get("steps") or []
    job = Job(
        run_id=run_id,
        run_dir=Path(data["run_dir"]),
        url=wait["gateway_url"],
        api_key=Path(key_file).read_text().strip(),
        bringup_s=wait.get("elapsed_s"),
        phases=steps,
    )
    return job, run_id, ""


def model_config(job: Job, preset: dict[str, Any]) -> dict[str, Any]:
    """The served model's config.json: the tiny/shape model in the run dir, a local directory or the HF
    cache's copy of a hub name."""
    built = job.run_dir / "model" / "config.json"
    if built.is_file():
        return json.loads(built.read_text())
    path = (preset.get("model") or {}).get("path") or ""
    if Path(path, "config.json").is_file():
        return json.loads(Path(path, "config.json").read_text())
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    raise BenchError(f"cannot find the served model's config.json (model.path {path!r})")


PUSH_LINE = re.compile(r"^miles_push_seconds_(sum|count)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def push_totals(url: str) -> tuple[float, float] | None:
    """(seconds, pushes) so far from the gateway's /metrics (every kind); None if not exposed."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = {"sum": 0.0, "count": 0.0}
    seen = False
    for line in text.splitlines():
        match = PUSH_LINE.match(line.strip())
        if match:
            seen = True
            totals[match.group(1)] += float(match.group(3))
    return (totals["sum"], totals["count"]) if seen else None


def engine_decode_paths(run_dir: Path) -> list[dict[str, Any]]:
    """Each engine's decode path and how its steps ran (a CPU engine's /get_server_info; an SGLang engine
    reports neither): whether the job's sampling replayed CUDA graphs. The engines' URLs are in
    RUN_DIR/cells.json, their key in RUN_DIR/engine_api_key."""
    import httpx

    try:
        cells = json.loads((run_dir / "cells.json").read_text())
        key = (run_dir / "engine_api_key").read_text().strip()
    except (OSError, ValueError) as exc:
        return [{"error": f"no engine facts in {run_dir}: {exc}"}]
    found = []
    for engine in cells.get("engines", []):
        fact: dict[str, Any] = {"index": engine.get("index"), "url": engine.get("url")}
        try:
            info = httpx.get(
                f"{engine['url']}/get_server_info", headers={"Authorization": f"Bearer {key}"}, timeout=10
            ).json()
            state = info["internal_states"][0]
            fact.update(
                decode_mode=state.get("decode_mode"),
                decode_counts=state.get("decode_counts"),
                tensor_loads=state.get("tensor_loads"),
            )
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            fact["error"] = repr(exc)
        found.append(fact)
    return found


def push_steps(run_dir: Path, skip: int = 2) -> dict[str, float]:
    """Median seconds of each timed step of the job's pushes (the run's `push` events, their
    `steps`: describe, quiesce, buckets, release, the trainer's parts...), the first `skip` (bring-up's
    and the warm-up's) left out: where a weight sync's time goes."""
    return median_steps(run_dir, lambda e: e["kind"] == "push", skip)


def switch_steps(run_dir: Path, skip: int = 1) -> dict[str, float]:
    """Median seconds of the steps of a colocated job's switches to sampling (the `colocation` events':
    trainer, resume, push), the warm-up's left out: the rest of a weight sync."""
    return median_steps(run_dir, lambda e: e["kind"] == "colocation" and e.get("phase") == "sampling", skip)


def median_steps(run_dir: Path, wanted: Callable[[dict[str, Any]], bool], skip: int) -> dict[str, float]:
    from miles.contract.events import read_events

    steps = [e["steps"] for e in read_events(run_dir) if wanted(e) and e.get("steps")][skip:]
    names = {name for s in steps for name in s}
    return {name: statistics.median(s[name] for s in steps if name in s) for name in sorted(names)}


def run_job_loop(
    job: Job, cfg: LoopConfig, args: argparse.Namespace, gpu: GpuSampler
) -> tuple[list[StepRow], dict[str, Any]]:
    import tinker
    from tinker import types

    preset = job.preset()
    model = preset.get("model") or {}
    vocab = int(model_config(job, preset)["vocab_size"])
    full = model.get("train_mode") == "full"
    rank = 0 if full else int(args.rank or model.get("lora_rank") or 32)
    prompts = make_prompts(vocab, cfg)
    timeout = args.request_timeout

    service = tinker.ServiceClient(base_url=job.url, api_key=job.api_key)
    training = service.create_lora_training_client(base_model=model["name"], rank=rank).result(
        timeout=timeout
    )
    t0 = time.perf_counter()
    sampling = training.save_weights_and_get_sampling_client().result(timeout=timeout)
    first_sync_s = time.perf_counter() - t0
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=[])
    adam = types.AdamParams(learning_rate=cfg.lr)
    loss_config = PPO_CLIP if cfg.loss == "ppo" else None
    model_inputs = [types.ModelInput.from_ints(p) for p in prompts]
    rows: list[StepRow] = []
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("job", total=cfg.total_steps)
        for step in range(cfg.total_steps):
            pushes_before = push_totals(job.url)
            start = time.perf_counter()
            futures = [
                sampling.sample(prompt=m, num_samples=cfg.samples, sampling_params=params)
                for m in model_inputs
            ]
            results = [f.result(timeout=timeout) for f in futures]
            sampled_at = time.perf_counter()

            data, sampler_lps, rewards = [], [], []
            for prompt, result in zip(prompts, results, strict=True):
                group = []
                for seq in result.sequences:
                    tokens = list(seq.tokens)
                    if seq.logprobs is None:
                        raise BenchError("the sampler returned no logprobs")
                    lps = np.asarray(seq.logprobs, np.float32)
                    group.append(reward(tokens, vocab))
                    sampler_lps.append(lps)
                    data.append((prompt, tokens, lps))
                rewards.append(group)
            advantages = [a for group in group_advantages(rewards) for a in group]
            datums = []
            for (prompt, tokens, lps), adv in zip(data, advantages, strict=True):
                full_seq = prompt + tokens
                pad = len(prompt) - 1
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full_seq[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.asarray(full_seq[1:], np.int64),
                            "logprobs": np.concatenate([np.zeros(pad, np.float32), lps]),
                            "advantages": np.concatenate(
                                [np.zeros(pad, np.float32), np.full(len(tokens), adv, np.float32)]
                            ),
                        },
                    )
                )
            train_start = time.perf_counter()
            fb = training.forward_backward(datums, cfg.loss, loss_fn_config=loss_config)
            opt = training.optim_step(adam)  # pipelined, as the SDK intends: submitted before fb's result
            fb_out = fb.result(timeout=timeout)
            opt.result(timeout=timeout)
            trained_at = time.perf_counter()
            if cfg.saves_at(step):  # tinker-cookbook's save_every: a named snapshot, sampled by its path
                path = training.save_weights_for_sampler(f"step-{step:04d}").result(timeout=timeout).path
                sampling = service.create_sampling_client(model_path=path).result(timeout=timeout)
            else:
                sampling = training.save_weights_and_get_sampling_client().result(timeout=timeout)
            end = time.perf_counter()
            pushes_after = push_totals(job.url)

            trainer_lps = [
                o["logprobs"].to_numpy()[-len(lps) :] if len(lps) else np.zeros(0, np.float32)
                for o, lps in zip(fb_out.loss_fn_outputs, sampler_lps, strict=True)
            ]
            kl_v1, kl_v2 = kl_sample_train(sampler_lps, trainer_lps)
            sampled = sum(len(lps) for lps in sampler_lps)
            trained = sum(len(p) + len(t) for p, t, _ in data)
            push_ms = None
            if pushes_before is not None and pushes_after is not None and pushes_after[1] > pushes_before[1]:
                push_ms = (pushes_after[0] - pushes_before[0]) * 1000
            idle, util, count = idle_seconds(gpu, start, end)
            row = StepRow(
                step=step,
                warmup=step < cfg.warmup,
                sample_s=sampled_at - start,
                sampled_tokens=sampled,
                sample_tps=sampled / (sampled_at - start),
                train_s=trained_at - train_start,
                train_tokens=trained,
                train_tps=trained / (trained_at - train_start),
                sync_ms=(end - trained_at) * 1000,
                push_ms=push_ms,
                step_s=end - start,
                gpu_idle_s=idle,
                gpu_util_mean=util,
                gpu_samples=count,
                kl_v1=kl_v1,
                kl_v2=kl_v2,
                reward_mean=float(np.mean([r for g in rewards for r in g])),
                loss_sum=float(fb_out.metrics.get("loss:sum", float("nan"))),
                saved=cfg.saves_at(step),
            )
            rows.append(row)
            progress.update(
                task, advance=1, description=f"job: step {step} {row.step_s:.2f} s, kl {row.kl_v1:+.2e}"
            )
    info = {
        "run_id": job.run_id,
        "run_dir": str(job.run_dir),
        "bringup_s": job.bringup_s,
        "phases": job.phases,
        "model": model.get("name"),
        "train_mode": model.get("train_mode"),
        "rank": rank,
        "vocab": vocab,
        "first_sync_s": first_sync_s,
        "engines": engine_decode_paths(job.run_dir),
        "push_steps": push_steps(job.run_dir, skip=1 + cfg.warmup),  # bring-up's push, the warm-up's
        "switch_steps": switch_steps(job.run_dir, skip=cfg.warmup),
    }
    return rows, info


# ---- the plain loop (its own process) -------------------------------------------------------------------


def run_plain(
    cfg: LoopConfig, args: argparse.Namespace, job: Job | None
) -> tuple[list[StepRow], dict[str, Any]]:
    cmd = [sys.executable, str(REPO / "bench" / "rl_baseline.py"), "--config", json.dumps(asdict(cfg))]
    built = job.run_dir / "model" if job is not None else None
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    elif built is not None and (built / "config.json").is_file():
        cmd += ["--model-dir", str(built)]  # the very weights the job's driver built
    else:
        cmd += ["--preset", args.preset, *[f"--set={o}" for o in args.overrides]]
        if job is not None:
            cmd += ["--run-dir", str(job.run_dir)]
    with tempfile.TemporaryDirectory(prefix="rl-plain-") as tmp:
        result_file = Path(tmp) / "plain.json"
        cmd += ["--out", str(result_file)]
        console.print(f"[bold]plain loop[/] {' '.join(cmd[1:3])} ...")
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=args.baseline_timeout)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"the plain loop ran past --baseline-timeout {args.baseline_timeout} s") from exc
        if proc.returncode != 0 or not result_file.is_file():
            raise BenchError(f"the plain loop failed (exit {proc.returncode}); its output is above")
        result = json.loads(result_file.read_text())
    rows = [row_from_dict(r) for r in result.pop("rows")]
    return rows, result


# ---- output ---------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else format(value, spec)


def step_table(title: str, rows: Sequence[StepRow]) -> Table:
    table = Table(title=title, title_justify="left")
    for name in (
        "step", "sample s", "sample tok/s", "train s", "train tok/s", "sync ms", "push ms",
        "step s", "GPU idle s", "GPU util %", "kl v1", "kl v2", "reward", "loss:sum",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            f"{r.step}{' (warm-up)' if r.warmup else ''}{' (saved)' if r.saved else ''}",
            _fmt(r.sample_s, ".3f"),
            _fmt(r.sample_tps, ",.0f"),
            _fmt(r.train_s, ".3f"),
            _fmt(r.train_tps, ",.0f"),
            _fmt(r.sync_ms, ",.1f"),
            _fmt(r.push_ms, ",.1f"),
            _fmt(r.step_s, ".3f"),
            _fmt(r.gpu_idle_s, ".3f"),
            _fmt(r.gpu_util_mean, ".0f"),
            _fmt(r.kl_v1, "+.2e"),
            _fmt(r.kl_v2, ".2e"),
            _fmt(r.reward_mean, ".3f"),
            _fmt(r.loss_sum, ".4g"),
        )
    return table


SUMMARY_ROWS = (
    ("step s", "step_s", ".3f"),
    ("sampling s", "sample_s", ".3f"),
    ("sampling tokens/s", "sample_tps", ",.0f"),
    ("training s", "train_s", ".3f"),
    ("training tokens/s", "train_tps", ",.0f"),
    ("weight sync ms", "sync_ms", ",.1f"),
    ("named save ms (--save-every)", "saved_sync_ms", ",.1f"),
    ("server push ms", "push_ms", ",.1f"),
    ("GPU idle s", "gpu_idle_s", ".3f"),
    ("GPU util %", "gpu_util_mean", ".0f"),
    ("kl_sample_train_v1", "kl_v1", "+.2e"),
    ("kl_sample_train_v2", "kl_v2", ".2e"),
    ("reward", "reward_mean", ".3f"),
)
RATIO_FIELDS = ("step_s", "sample_tps", "train_tps", "saved_sync_ms")


def ratios(job: dict[str, Any] | None, plain: dict[str, Any] | None) -> dict[str, float | None]:
    out_: dict[str, float | None] = {}
    for name in RATIO_FIELDS:
        a = job.get(name) if job else None
        b = plain.get(name) if plain else None
        out_[name] = a / b if a is not None and b else None
    return out_


def summary_table(job: dict[str, Any] | None, plain: dict[str, Any] | None, ratio: dict[str, Any]) -> Table:
    table = Table(title="medians of the measured steps; ratio = job / plain", title_justify="left")
    for name in ("metric", "whole job", "plain", "ratio"):
        table.add_column(name, justify="right" if name != "metric" else "left")
    for label, key, spec in SUMMARY_ROWS:
        table.add_row(
            label,
            _fmt(job.get(key) if job else None, spec),
            _fmt(plain.get(key) if plain else None, spec),
            _fmt(ratio.get(key), ".3f") + ("x" if ratio.get(key) is not None else ""),
        )
    return table


def git_info() -> dict[str, Any]:
    """The commit measured: MILES_GIT_COMMIT when set (a device machine's copy of the tree may carry a
    stale .git of its own), else git's."""
    if os.environ.get("MILES_GIT_COMMIT"):
        return {"commit": os.environ["MILES_GIT_COMMIT"], "dirty": None}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO, capture_output=True, text=True, timeout=10,
        ).stdout.strip() != ""  # fmt: skip
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get("MILES_GIT_COMMIT"), "dirty": None}


def device_info(gpu: GpuSampler, plain: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "gpus": gpu.names,
        "gpu_sampler": gpu.kind,
        "plain_device": plain.get("device") if plain else None,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


# ---- main -----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default=DEFAULT_PRESET)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--groups", "-G", type=int, default=LoopConfig.groups)
    parser.add_argument("--samples", "-N", type=int, default=LoopConfig.samples, help="samples per group")
    parser.add_argument("--max-tokens", "-T", type=int, default=LoopConfig.max_tokens)
    parser.add_argument("--steps", "-S", type=int, default=LoopConfig.steps, help="measured steps")
    parser.add_argument("--warmup", type=int, default=LoopConfig.warmup, help="steps left out of the medians")
    parser.add_argument("--prompt-len", type=int, default=LoopConfig.prompt_len)
    parser.add_argument("--loss", choices=LOSSES, default=LoopConfig.loss)
    parser.add_argument("--lr", type=float, default=LoopConfig.lr)
    parser.add_argument("--temperature", type=float, default=LoopConfig.temperature)
    parser.add_argument("--seed", type=int, default=LoopConfig.seed, help="the prompts' seed")
    parser.add_argument(
        "--save-every",
        type=int,
        default=LoopConfig.save_every,
        help="every N steps a named, kept snapshot (the job: save_weights_for_sampler(name); the plain loop: "
        "save_pretrained); 0: never",
    )
    parser.add_argument("--rank", type=int, default=None, help="LoRA rank (lora jobs; default the preset's)")
    parser.add_argument("--model-dir", default=None, help="the plain loop's model (default: the job's)")
    parser.add_argument("--skip-job", action="store_true")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the job to come up")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per SDK call")
    parser.add_argument("--baseline-timeout", type=float, default=1800.0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write everything here")
    args = parser.parse_args(argv)
    if args.skip_job and args.skip_baseline:
        parser.error("--skip-job and --skip-baseline leave nothing to run")
    for name in ("groups", "samples", "max_tokens", "steps", "prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.save_every < 0:
        parser.error("--warmup and --save-every must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    cfg = LoopConfig(
        groups=args.groups,
        samples=args.samples,
        max_tokens=args.max_tokens,
        steps=args.steps,
        warmup=args.warmup,
        prompt_len=args.prompt_len,
        loss=args.loss,
        lr=args.lr,
        temperature=args.temperature,
        seed=args.seed,
        save_every=args.save_every,
    )
    gpu = GpuSampler().start()
    report: dict[str, Any] = {
        "bench": "rl_loop",
        "config": {**asdict(cfg), "preset": args.preset, "overrides": args.overrides},
        "git": git_info(),
        "job": None,
        "plain": None,
    }
    job_rows: list[StepRow] = []
    plain_rows: list[StepRow] = []
    job: Job | None = None
    code = 0
    try:
        if not args.skip_job:
            job, run_id, why = submit(args)
            if job is None:
                if run_id:
                    tail = log_tail(run_id)
                    cancel(run_id, gpu, wait_s=30)
                    why += f"\n--- launcher logs {run_id} --tail {LOG_TAIL_LINES} ---\n{tail}"
                raise BenchError(f"the job did not come up: {why}", code=3)
            console.print(f"[bold]{job.run_id}[/] serving at {job.url} after {job.bringup_s or 0:.1f} s")
            try:
                job_rows, info = run_job_loop(job, cfg, args, gpu)
            except BenchError:
                raise
            except Exception as exc:
                tail = log_tail(job.run_id)
                raise BenchError(
                    f"the loop through the job failed: {type(exc).__name__}: {exc}\n"
                    f"--- launcher logs {job.run_id} --tail {LOG_TAIL_LINES} ---\n{tail}",
                    code=4,
                ) from exc
            finally:
                state = cancel(job.run_id, gpu)
                console.print(f"[bold]{job.run_id}[/] cancelled ({state})")
            report["job"] = {**info, "rows": [asdict(r) for r in job_rows], "summary": summarize(job_rows)}
            out.print(step_table(f"whole job ({args.preset})", job_rows))
            for engine in info["engines"]:
                out.print(
                    f"engine {engine.get('index')}: decode {engine.get('decode_mode')} "
                    f"{engine.get('decode_counts') or engine.get('error', '')}; "
                    f"tensor loads {engine.get('tensor_loads')}"
                )
            for what in ("switch", "push"):
                steps = ", ".join(f"{n} {s * 1000:.1f}" for n, s in info[f"{what}_steps"].items())
                out.print(f"{what} steps, median ms: {steps or 'none recorded'}")
        if not args.skip_baseline:
            plain_rows, plain_info = run_plain(cfg, args, job)
            report["plain"] = {
                **plain_info,
                "rows": [asdict(r) for r in plain_rows],
                "summary": summarize(plain_rows),
            }
            out.print(
                step_table(f"plain loop ({plain_info.get('device')}, {plain_info.get('dtype')})", plain_rows)
            )
    except BenchError as exc:
        console.print(f"[bold red]rl_loop:[/] {exc}", markup=True, highlight=False)
        report["error"] = str(exc)
        code = exc.code
    finally:
        gpu.stop()
    job_summary = report["job"]["summary"] if report["job"] else None
    plain_summary = report["plain"]["summary"] if report["plain"] else None
    report["ratios"] = ratios(job_summary, plain_summary)
    report["device"] = device_info(gpu, report["plain"])
    if job_summary or plain_summary:
        out.print(summary_table(job_summary, plain_summary, report["ratios"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    return code


if __name__ == "__main__":
    sys.exit(main())
