"""Soak: many full-weight pushes of a small model, TCP resets on a fraction of buckets, sampling meanwhile.

    .venv/bin/python bench/soak.py [--pushes 1000] [--max-minutes 15] [--reset-fraction 0.03]
                                   [--samplers 2] [--busy-procs 0] [--json out.json]

The stack is the production one on loopback: real Ray, a full fine-tuning trainer cell, two CPU engine
cells, the InferenceController (health checks on) and RayRuntime. The driver's client for engine 1 goes
through a relay (tools/faults/reset_relay.py) that resets the connection in the middle of a fraction of
the `update_weights_from_distributed` POSTs, half of them after the whole request reached the engine and
half after half its body. Meanwhile `--samplers` loops sample from the base model through RayRuntime, as
the gateway does. `--busy-procs K` starves the trainer's node of CPU as on the incident's head node: the
driver and the trainer cell are pinned to one core that K busy processes share with them.

Reported: pushes completed; pushes aborted cleanly (the reset's transport error, naming the endpoint,
lock released, no engine routed to until the next push); pushes that failed otherwise (with their
messages); leaked locks (a push that returned or raised with the controller's update lock still held);
samples completed, failed with a clear error (the error family's: a category the gateway maps to a
status, and a message naming what happened) and failed without one (anything else, a 500 at the gateway);
both engines' prompt logprobs at the end against the start (the weights pushed never change, so an engine
left with a half-updated bucket would differ); and the RSS of the driver, the trainer cell and each
engine at the start and the end. Bounded by --pushes and --max-minutes, whichever ends first. Numbers are
recorded in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ (the relay), next to miles/

import httpx
import numpy as np
import psutil

from miles.errors import MilesError
from miles.types import LogprobSpec, SamplingParams
from tools.faults.reset_relay import ResetRelay

BASE = "tiny/base"
PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11]
SHORT = SamplingParams(max_tokens=4, temperature=1.0, seed=5)


@dataclass
class SoakReport:
    pushes_started: int = 0
    pushes_completed: int = 0
    pushes_aborted_cleanly: int = 0
    pushes_failed_otherwise: list[str] = field(default_factory=list)
    leaked_locks: int = 0
    resets_injected: int = 0
    buckets_through_relay: int = 0
    samples_completed: int = 0
    samples_failed_clearly: dict[str, int] = field(default_factory=dict)
    samples_failed_unclearly: list[str] = field(default_factory=list)
    engines_match_start_at_end: bool = False
    max_logprob_diff_at_end: float = 0.0
    rss_mib_start: dict[str, float] = field(default_factory=dict)
    rss_mib_end: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    push_seconds_median: float = 0.0
    push_seconds_max: float = 0.0
    stopped_by: str = ""
    busy_procs: int = 0


def rss_mib(model_dir: Path) -> dict[str, float]:
    """RSS of this driver, the trainer cell's process and each engine process of this run (by model dir)."""
    out = {"driver": psutil.Process().memory_info().rss / 2**20}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            if "miles.engines.cpu" in cmd and str(model_dir) in cmd:
                out[f"engine pid {proc.pid}"] = proc.memory_info().rss / 2**20
            elif cmd.startswith("ray::TrainerWorker"):
                out["trainer cell"] = proc.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return {k: round(v, 1) for k, v in out.items()}


def trainer_pid() -> int | None:
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("ray::TrainerWorker"):
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    return None


@contextmanager
def starved(busy_procs: int):
    """The driver and the trainer cell pinned to one core that `busy_procs` busy processes share."""
    if busy_procs == 0:
        yield
        return
    before = os.sched_getaffinity(0)
    core = {min(before)}
    pinned = [0] + [pid for pid in [trainer_pid()] if pid is not None]
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(busy_procs)
    ]
    try:
        for pid in pinned + [p.pid for p in spinners]:
            os.sched_setaffinity(pid, core)
        yield
    finally:
        for pid in pinned:
            try:
                os.sched_setaffinity(pid, before)
            except ProcessLookupError:
                pass
        for proc in spinners:
            proc.kill()
            proc.wait()


async def prompt_logprobs(client) -> np.ndarray:
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return np.asarray([p[0] for p in out["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


async def sample_loop(runtime, target, stop: asyncio.Event, report: SoakReport) -> None:
    clear: collections.Counter[str] = collections.Counter(report.samples_failed_clearly)
    while not stop.is_set():
        try:
            await runtime.sample(target, PROMPT, SHORT, 1, LogprobSpec())
            report.samples_completed += 1
        except MilesError as exc:  # the error family: a category the gateway maps to a status, a message
            clear[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
        except Exception as exc:  # what the soak is looking for
            report.samples_failed_unclearly.append(f"{type(exc).__name__}: {exc}"[:300])
        report.samples_failed_clearly = dict(clear)
        await asyncio.sleep(0.02)


async def push_loop(controller, trainer, config, relay: ResetRelay, opts, report: SoakReport) -> None:
    from miles.weights.push import push_full_weights

    rng = random.Random(opts.seed)
    deadline = time.monotonic() + opts.max_minutes * 60
    durations = []
    for _ in range(opts.pushes):
        if time.monotonic() > deadline:
            report.stopped_by = f"--max-minutes {opts.max_minutes:g}"
            return
        relay.deliver = rng.random() < 0.5
        resets = relay.resets
        report.pushes_started += 1
        started = time.monotonic()
        try:
            await push_full_weights(controller, trainer, config)
            report.pushes_completed += 1
        except httpx.TransportError as exc:
            named = relay.url in "".join(getattr(exc, "__notes__", []))
            released = not controller.update_in_progress
            clean = named and released and relay.resets > resets and controller.ready_engines() == []
            if clean:
                report.pushes_aborted_cleanly += 1
            else:
                report.pushes_failed_otherwise.append(f"{type(exc).__name__}: {exc}"[:300])
        except Exception as exc:  # what the soak is looking for
            report.pushes_failed_otherwise.append(f"{type(exc).__name__}: {exc}"[:300])
        durations.append(time.monotonic() - started)
        report.push_seconds_median = round(float(np.median(durations)), 3)
        report.push_seconds_max = round(max(durations), 3)
        if controller.update_in_progress:
            report.leaked_locks += 1
        await asyncio.sleep(opts.push_interval_s)  # a training step's time: samples meet ready engines
        if report.pushes_started % 50 == 0:
            print(
                f"{report.pushes_started} pushes: {report.pushes_completed} completed, "
                f"{report.pushes_aborted_cleanly} aborted cleanly, {len(report.pushes_failed_otherwise)} "
                f"otherwise, {report.samples_completed} samples",
                flush=True,
            )
    report.stopped_by = f"--pushes {opts.pushes}"


async def soak(opts: argparse.Namespace, model_dir: Path) -> SoakReport:
    import ray
    from ray.util.placement_group import remove_placement_group

    from miles.cluster.placement import create_gpu_placement_group
    from miles.engines.config import EngineConfig
    from miles.engines.sglang_client import SGLangApiClient
    from miles.rollout.controller import InferenceController
    from miles.rollout.engine_cell import EngineCell
    from miles.rollout.health import HealthCheckConfig
    from miles.runtime.ray_runtime import RayRuntime
    from miles.seam.runtime import ModelCard, SamplerTarget
    from miles.train.cell import TrainerCell
    from miles.train.controller import TrainerController
    from miles.weights.push import PushConfig, push_full_weights

    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-soak-"))
    report = SoakReport(busy_procs=opts.busy_procs)
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    engines = EngineConfig(model_path=str(model_dir), num_cpus=1, startup_timeout_s=300)
    health = HealthCheckConfig(interval_s=2, timeout_s=5, failure_threshold=3)
    controller = InferenceController([EngineCell(i, engines, (pg, 1 + i)) for i in range(2)], health=health)
    cell = TrainerCell(0)
    await asyncio.gather(
        controller.start(), cell.start([(pg, 0)], model_path=str(model_dir), train_mode="full")
    )
    config = PushConfig(bucket_bytes=opts.bucket_kib * 1024, group_timeout_s=60, cleanup_timeout_s=20)
    card = ModelCard(
        name=BASE, max_context=2048, trainable=True, sampleable=True, train_mode="full", tokenizer_id=BASE
    )
    trainer = TrainerController([cell])
    runtime = RayRuntime(card, trainer, controller, push=config)
    relay = None
    try:
        await runtime.publish_initial_weights()
        controller.start_health_checks()
        before = [await prompt_logprobs(c.client) for c in controller.cells]
        direct = controller.cells[1].client
        rng = random.Random(opts.seed + 1)
        relay = ResetRelay(direct.base_url, lambda _: rng.random() < opts.reset_fraction, deliver=False)
        relay.url = await relay.start()
        controller.cells[1].client = SGLangApiClient(relay.url, weight_api=direct.weight_api)
        report.rss_mib_start = rss_mib(model_dir)
        stop = asyncio.Event()
        target = SamplerTarget(base_model=BASE)
        start = time.monotonic()
        with starved(opts.busy_procs):
            samplers = [sample_loop(runtime, target, stop, report) for _ in range(opts.samplers)]
            samplers = [asyncio.create_task(sampler) for sampler in samplers]
            try:
                await push_loop(controller, trainer, config, relay, opts, report)
            finally:
                stop.set()
                await asyncio.gather(*samplers)
        report.seconds = round(time.monotonic() - start, 1)
        report.resets_injected, report.buckets_through_relay = relay.resets, relay.seen
        relay.cut = lambda _: False
        if not controller.ready_engines():  # the last push was aborted: one more, so engines serve
            await push_full_weights(controller, trainer, config)
        after = [await prompt_logprobs(c.client) for c in controller.cells]
        diffs = [float(np.max(np.abs(a - b))) for a, b in zip(after, before, strict=True)]
        report.max_logprob_diff_at_end = max(diffs)
        report.engines_match_start_at_end = max(diffs) <= 1e-5
        report.rss_mib_end = rss_mib(model_dir)
        return report
    finally:
        if relay is not None:
            await relay.close()
        await runtime.close()
        remove_placement_group(pg)
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pushes", type=int, default=1000)
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--reset-fraction", type=float, default=0.03, help="of the buckets through engine 1")
    parser.add_argument("--bucket-kib", type=int, default=256)
    parser.add_argument("--samplers", type=int, default=2, help="sampling loops running meanwhile")
    parser.add_argument("--push-interval-s", type=float, default=0.2, help="pause between pushes")
    parser.add_argument("--busy-procs", type=int, default=0, help="starve the driver and trainer's core")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    if opts.pushes < 1 or opts.max_minutes <= 0 or not 0 <= opts.reset_fraction <= 1 or opts.busy_procs < 0:
        parser.error("--pushes >= 1, --max-minutes > 0, --reset-fraction in [0, 1], --busy-procs >= 0")
    from miles.models.tiny import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="soak-model-")))
    report = asyncio.run(soak(opts, model_dir))
    print(json.dumps(asdict(report), indent=2))
    if opts.json:
        opts.json.write_text(json.dumps(asdict(report), indent=2) + "\n")


if __name__ == "__main__":
    main()
