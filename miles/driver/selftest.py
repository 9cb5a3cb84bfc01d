"""The driver's half of `launcher selftest` (preset `selftest.enabled`): the job checks its own pieces in
order and writes one row per check to RUN_DIR/selftest.jsonl (miles.contract.selftest), then kills its own
trainer so the launcher can time the job ending itself.

Order: Ray's view of the nodes and the interconnect (before the cells take the GPUs), the bring-up phases
(placement, cells, first weights, gateway; timed from the driver's timeline), every engine call around a
push, then a user's first RL step through the gateway with the real tinker SDK (train, push, sample, the
sampler-vs-trainer check), then the watchdog. The first failing check ends the sequence; its row names the
node, the log and a hint, and the driver exits: JobExit.SELFTEST_FAILED (6) after bring-up, STARTUP_FAILED
(2) when the bring-up itself failed (as any job's would).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miles.contract.ports import read_port_files
from miles.contract.preset import Preset
from miles.contract.selftest import SelftestRow, Status, append_row

log = logging.getLogger("miles.driver.selftest")

DRIVER_LOG = "logs/driver.log"
HEALTHZ_503_TIMEOUT_S = 60.0
# A check that hangs (a proxy swallowing the SDK's calls, an engine that never answers) fails its row after
# this long instead of waiting for the launcher's --timeout; a large model's first step takes minutes.
STEP_TIMEOUT_S = 900.0
HEALTHZ_POLL_S = 0.25
# the phases of the driver's timeline (miles.driver.serve.Timeline) that make up each bring-up row
BRINGUP_ROWS: tuple[tuple[str, str], ...] = (
    ("placement", "model"),
    ("cells", "cells"),
    ("weights", "weights"),
    ("gateway", "gateway"),
)


class StepFailed(Exception):
    """A check failed and its row is written: the sequence stops."""


@dataclass
class Outcome:
    """What a check fills in while it runs; the recorder turns it into the row."""

    detail: str = ""
    status: Status = "pass"
    node: str | None = None
    log: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


class Recorder:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.failed: str | None = None

    def write(self, row: SelftestRow) -> None:
        log.info("selftest %-10s %-4s %s", row.step, row.status, row.detail)
        if row.status == "fail" and self.failed is None:
            self.failed = row.step
        append_row(self.run_dir, row)

    @contextlib.asynccontextmanager
    async def step(
        self,
        name: str,
        *,
        log_file: str = DRIVER_LOG,
        timeout_s: float = STEP_TIMEOUT_S,
        health: Callable[[], str | None] | None = None,
    ) -> AsyncIterator[Outcome]:
        """Time the body, bounded by `timeout_s`; an exception becomes the step's failed row (then
        StepFailed). A blocking call the body runs in a thread is abandoned, not stopped: the job ends.
        `health`: the runtime's own account of what is broken, added to a failure (an SDK error alone
        may say only that a call failed)."""
        outcome = Outcome(log=log_file)
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                yield outcome
        except StepFailed:
            raise
        except TimeoutError as exc:
            detail = f"no answer within {timeout_s:.0f} s" + (
                f" ({outcome.detail})" if outcome.detail else ""
            )
            self.write(_row(name, "fail", time.monotonic() - started, outcome, detail=detail))
            raise StepFailed(name) from exc
        except Exception as exc:
            log.exception("selftest step %s failed", name)
            detail = _describe(exc)
            problem = health() if health is not None else None
            if problem and problem not in detail:
                detail = f"{' '.join(problem.split())}; the call: {detail}"
            self.write(_row(name, "fail", time.monotonic() - started, outcome, detail=detail))
            raise StepFailed(name) from exc
        self.write(_row(name, outcome.status, time.monotonic() - started, outcome))


def _row(
    name: str, status: Status, seconds: float, outcome: Outcome, detail: str | None = None
) -> SelftestRow:
    return SelftestRow(
        step=name,
        status=status,
        seconds=round(seconds, 3),
        detail=outcome.detail if detail is None else detail,
        node=outcome.node,
        log=outcome.log,
        data=outcome.data,
    )


def _describe(exc: BaseException) -> str:
    """One line: Ray's actor dumps and the SDK's wrappers span several (the table shows one per row)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 2000 else text[:2000] + " ..."


# ---- Ray's view of the nodes --------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeFacts:
    ip: str
    gpus: float
    cpus: float


def node_problems(nodes: Sequence[NodeFacts], expected: int, gpus_per_node: int) -> list[tuple[str, str]]:
    """(node, problem) for every way Ray's view differs from what the preset asks."""
    problems: list[tuple[str, str]] = []
    if len(nodes) != expected:
        seen = ", ".join(sorted(n.ip for n in nodes)) or "none"
        problems.append(
            ("", f"Ray sees {len(nodes)} node(s) of this job ({seen}); the preset asks for {expected}")
        )
    for node in nodes:
        if node.gpus != gpus_per_node:
            problems.append(
                (node.ip, f"{node.ip} offers {node.gpus:g} GPU(s); gpus_per_node is {gpus_per_node}")
            )
        if node.cpus < gpus_per_node or node.cpus < 1:  # every GPU's bundle books one CPU
            problems.append(
                (
                    node.ip,
                    f"{node.ip} offers {node.cpus:g} CPU(s) to Ray; its {gpus_per_node} GPU bundles need "
                    f"{max(gpus_per_node, 1)}: raise ray.num_cpus or the CPUs the scheduler gives each node",
                )
            )
    return problems


def job_nodes(label: str | None) -> list[NodeFacts]:
    from miles.cluster.ray_setup import alive_nodes

    facts = []
    for node in alive_nodes():
        resources = node.get("Resources", {})
        if label and label not in resources:  # another job's node on a shared Ray: not ours
            continue
        facts.append(
            NodeFacts(node["NodeManagerAddress"], resources.get("GPU", 0.0), resources.get("CPU", 0.0))
        )
    return sorted(facts, key=lambda n: n.ip)


def job_ports(run_dir: Path) -> dict[str, int]:
    """The ports the job script claimed on the head (RUN_DIR/ports/head.env)."""
    return read_port_files(run_dir / "ports").get("head", {})


async def check_cluster(preset: Preset, recorder: Recorder) -> None:
    """Rows `ray` and `collective` (the driver runs this after connecting, before the cells start)."""
    async with recorder.step("ray") as out:
        nodes = await asyncio.to_thread(job_nodes, os.environ.get("MILES_RAY_JOB_LABEL"))
        problems = node_problems(nodes, preset.nodes, preset.gpus_per_node)
        if problems:
            out.node = problems[0][0] or None
            raise RuntimeError("; ".join(text for _, text in problems))
        ports = job_ports(recorder.run_dir)
        listed = ", ".join(f"{n.ip} ({n.gpus:g} GPU, {n.cpus:g} CPU)" for n in nodes)
        out.detail = f"{len(nodes)} node(s): {listed}" + (f"; ports {_ports_text(ports)}" if ports else "")
        out.data = {"nodes": [vars(n) for n in nodes], "ports": ports}
    async with recorder.step("collective") as out:
        report = await _collective(preset)
        out.detail = report.summary(preset.selftest.interconnect_gbps)
        out.data = {
            "backend": report.backend,
            "ranks": report.ranks,
            "timings": [
                {
                    "collective": t.collective,
                    "bytes": t.nbytes,
                    "seconds": t.seconds,
                    "busbw_gbps": t.busbw_gbps,
                }
                for t in report.timings
            ],
        }


def _ports_text(ports: dict[str, int]) -> str:
    return ", ".join(f"{name.removesuffix('_PORT').lower()} {port}" for name, port in sorted(ports.items()))


async def _collective(preset: Preset) -> Any:
    import torch

    from miles.cluster.collective_check import Backend, run_collective_check

    real_gpus = preset.gpus_per_node > 0 and torch.cuda.is_available()
    backend: Backend = "nccl" if real_gpus else "gloo"
    nbytes = int(preset.selftest.collective_mb * (1 << 20)) // 4 * 4
    return await run_collective_check(preset.nodes, preset.gpus_per_node, backend, nbytes)


# ---- bring-up ----------------------------------------------------------------------------------------


def bringup_rows(
    marks: Sequence[tuple[str, float]],
    now: float,
    error: BaseException | None,
    details: dict[str, str] | None = None,
    run_dir: Path | None = None,
) -> list[SelftestRow]:
    """The rows of the bring-up phases from the timeline's marks (name, seconds since start) and what each
    mark said; `error`: the bring-up failed in the last phase marked (its row fails and names the log with
    the error, the later rows are not written)."""
    starts = dict(marks)
    order = [name for name, _ in marks]
    details = details or {}
    rows = []
    for row_name, phase in BRINGUP_ROWS:
        if phase not in starts:
            break
        later = [starts[p] for p in order[order.index(phase) + 1 :]]
        if row_name == "placement":  # the model's files and the placement group: one row
            later = [starts["cells"]] if "cells" in starts else []
        failed = error is not None and not later
        end = later[0] if later else now
        row = SelftestRow(
            step=row_name,
            status="fail" if failed else "pass",
            seconds=round(end - starts[phase], 3),
            detail=details.get("placement" if row_name == "placement" else phase, ""),
            log=DRIVER_LOG,
        )
        if failed and error is not None:
            row = _failed_bringup(row, error, run_dir)
        rows.append(row)
        if failed:
            break
    return rows


def _failed_bringup(row: SelftestRow, error: BaseException, run_dir: Path | None) -> SelftestRow:
    """The error, and where a component logged why (an engine that refused its flags, a trainer that
    could not load the model): the Ray error alone says only that an actor died."""
    culprit = last_logged_error(run_dir / "logs") if run_dir is not None else None
    detail = _describe(error)
    if culprit is None:
        return row.model_copy(update={"detail": detail})
    log_file, line = culprit
    node = RAY_ERROR_IP.search(str(error))
    if node:
        row = row.model_copy(update={"node": node.group(1)})
    return row.model_copy(
        update={"detail": f"{log_file}: {line} ({detail.splitlines()[0]})", "log": f"logs/{log_file}"}
    )


COMPONENT_LOGS = ("engine-*.log", "trainer-*.log")
# Ray's ActorDiedError names the dead actor's node ("ip: 10.0.0.3"): the node of a failed bring-up row
RAY_ERROR_IP = re.compile(r"\bip: ([0-9a-fA-F.:]+)")
EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Refused|Failed)\b.*")


def last_logged_error(logs_dir: Path) -> tuple[str, str] | None:
    """(log file name, the last exception line in it) of the most recently written component log that
    has one; None when no component logged an exception."""
    files = [f for pattern in COMPONENT_LOGS for f in logs_dir.glob(pattern)]
    for path in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
        if found:
            return path.name, found[-1][:500]
    return None


# ---- the engines, then a user's first RL step through the gateway ------------------------------------


def gateway_url(preset: Preset) -> str:
    url = os.environ.get("MILES_GATEWAY_URL")
    if url:
        return url
    host = preset.gateway.host if preset.gateway.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{host}:{preset.gateway.port}"


def api_key(preset: Preset, run_dir: Path) -> str:
    """The first key the gateway accepts, read as the gateway read it (bring-up's `load_api_keys`)."""
    from miles.driver.bringup import load_api_keys

    return load_api_keys(preset, run_dir).first_key()


def vocab_size(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


async def check_engines(runtime: Any, recorder: Recorder) -> None:
    from miles.rollout.engine_check import EngineCheckFailed, check_engines

    async with recorder.step("engine_api") as out:
        try:
            async with _sampling_side(runtime):
                calls = await check_engines(runtime.inference, runtime.push.pause_mode)
        except EngineCheckFailed as exc:
            out.node = exc.url
            out.log = f"logs/{exc.engine}.log"
            raise
        out.detail = "; ".join(c.summary() for c in calls)
        out.data = {"engines": [{"engine": c.engine, "url": c.url, "calls_ms": dict(c.calls)} for c in calls]}


def _sampling_side(runtime: Any) -> contextlib.AbstractAsyncContextManager[None]:
    """Colocated: the engines hold the GPUs while the calls run (the trainer waits); split: nothing."""
    from miles.runtime.colocation import GpuPhase

    gate = getattr(runtime, "gate", None)
    return gate.hold(GpuPhase.SAMPLING) if gate is not None else contextlib.nullcontext()


async def check_rl_step(preset: Preset, runtime: Any, recorder: Recorder) -> None:
    from miles.driver import selftest_sdk as sdk

    card = runtime.card
    trainer_node = _trainer_node(runtime)
    lora_rank = preset.model.lora_rank if card.train_mode == "lora" else None
    if preset.selftest.drill == "dead_trainer":
        await _kill_trainer(runtime)
        await _until_dead(runtime)
    # these rows' log is the driver's: the SDK call's traceback and the trainer cell's state changes land
    # there (logs/gateway.log holds only the gateway's own errors, none for a refused or failed call)
    async with recorder.step("train", health=runtime.health_problem) as out:
        out.node = trainer_node
        vocab = vocab_size(card.tokenizer_path)
        key = api_key(preset, recorder.run_dir)
        url = gateway_url(preset)
        bypass_proxies(url)
        session = await asyncio.to_thread(sdk.open_session, url, key, card.name, lora_rank, vocab)
        result = await asyncio.to_thread(sdk.train_step, session)
        mode = f"LoRA rank {lora_rank}" if lora_rank else "full fine-tuning"
        out.detail = (
            f"{mode}: forward_backward + optim_step on {result['tokens']} tokens in "
            f"{result['seconds']:.2f} s (the first step: warm-up included), loss:sum {result['loss_sum']:.3f}"
        )
        out.data = result
    async with recorder.step("push", health=runtime.health_problem) as out:
        out.node = trainer_node
        result = await asyncio.to_thread(sdk.push, session)
        pushed = _last_push(recorder.run_dir)
        out.detail = f"save_weights_and_get_sampling_client {result['seconds'] * 1e3:.0f} ms ({pushed})"
        if card.train_mode == "lora":  # what an eviction and a respawned engine do; kl samples after it
            cycled = await check_adapter_reload(runtime)
            out.detail += f"; then {cycled}"
        out.data = result
    async with recorder.step("kl", health=runtime.health_problem) as out:
        out.node = trainer_node
        result = await asyncio.to_thread(sdk.sampler_vs_trainer, session)
        threshold = preset.selftest.kl_threshold
        out.data = {**result, "threshold": threshold}
        kl = result["kl_sample_train_v1"]
        out.detail = (
            f"kl_sample_train_v1 {kl:+.2e} (standard error {result['standard_error']:.1e}) over "
            f"{result['tokens']} sampled tokens; |max diff| {result['max_abs_diff']:.2e}; "
            f"threshold {threshold:g}"
        )
        if not abs(kl) < threshold:
            raise RuntimeError(out.detail + ": the engines' logprobs differ from the trainer's")


def bypass_proxies(url: str) -> None:
    """The tinker SDK's client honours http(s)_proxy: a proxy exported on HPC nodes (for hub downloads)
    must not carry the driver's own calls to its gateway (miles.utils.http's rule), or `train` hangs in
    the SDK's retries. Adds the gateway's host to NO_PROXY and no_proxy (both: urllib prefers lowercase)."""
    host = urlsplit(url).hostname
    if not host:
        return
    hosts: list[str] = []
    for name in ("no_proxy", "NO_PROXY"):
        for entry in os.environ.get(name, "").split(","):
            if entry.strip() and entry.strip() not in hosts:
                hosts.append(entry.strip())
    if host not in hosts:
        hosts.append(host)
    for name in ("no_proxy", "NO_PROXY"):
        os.environ[name] = ",".join(hosts)


async def check_adapter_reload(runtime: Any) -> str:
    from miles.rollout.engine_check import cycle_adapters

    async with _sampling_side(runtime):
        calls = await cycle_adapters(runtime.inference)
    return "; ".join(c.summary() for c in calls)


def _trainer_node(runtime: Any) -> str | None:
    """Rank 0's node (where a training step's failure is logged: logs/trainer-rank0.log)."""
    for cell in runtime.trainer.cells:
        for info in getattr(cell, "ranks_info", None) or []:
            if info.get("rank") == 0:
                return info.get("node_ip")
    return None


def _last_push(run_dir: Path) -> str:
    """What the runtime's last push or adapter load recorded in RUN_DIR/events.jsonl."""
    from miles.contract.events import read_events

    recorded = list(read_events(run_dir))
    pushes = [e for e in recorded if e.get("kind") == "push"]
    if not pushes:
        return "no push recorded"
    last = pushes[-1]
    text = f"{last.get('push')} push {float(last.get('seconds', 0)) * 1e3:.0f} ms"
    if last.get("buckets"):
        mib = int(last.get("bytes", 0)) / 2**20
        text += f", {last['buckets']} bucket(s), {mib:.1f} MiB to {last.get('engines')} engine(s)"
    # colocated: the switches that released the engines for the step and resumed them for the push
    switches = {e.get("phase"): e.get("seconds") for e in recorded if e.get("kind") == "colocation"}
    for phase in ("training", "sampling"):
        seconds = switches.get(phase)
        if isinstance(seconds, int | float):
            text += f"; switch to {phase} {seconds * 1e3:.0f} ms"
    return text


# ---- the watchdog ------------------------------------------------------------------------------------


async def check_watchdog(preset: Preset, runtime: Any, recorder: Recorder) -> None:
    """Kill every trainer rank, then time healthz until it answers 503 (the driver then ends the job)."""
    async with recorder.step("watchdog") as out:
        killed_at = time.time()
        started = time.monotonic()
        await _kill_trainer(runtime)
        status = await _healthz_until_503(f"{gateway_url(preset)}/api/v1/healthz", HEALTHZ_503_TIMEOUT_S)
        seconds = time.monotonic() - started
        if status != 503:
            raise RuntimeError(
                f"healthz still answered {status} {HEALTHZ_503_TIMEOUT_S:.0f} s after the trainer was killed"
            )
        out.detail = f"trainer killed; healthz 503 after {seconds:.1f} s; the job ends next"
        out.data = {"killed_at": killed_at, "healthz_503_after_s": round(seconds, 3)}


async def _kill_trainer(runtime: Any) -> None:
    import ray

    for cell in runtime.trainer.cells:
        for actor in cell.actors:
            ray.kill(actor, no_restart=True)


async def _until_dead(runtime: Any, timeout_s: float = HEALTHZ_503_TIMEOUT_S) -> None:
    """Until the runtime's own probe has seen the trainer die (bounded; the step after reports either way)."""
    deadline = time.monotonic() + timeout_s
    while runtime.health_problem() is None and time.monotonic() < deadline:
        await runtime.probe_trainers(timeout_s=5.0)
        if runtime.health_problem() is None:
            await asyncio.sleep(HEALTHZ_POLL_S)


async def _healthz_until_503(url: str, timeout_s: float) -> int | None:
    from miles.utils.http import get_async_client

    client = get_async_client(purpose="probe")
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            status = (await client.get(url)).status_code
            if status == 503:
                return status
        await asyncio.sleep(HEALTHZ_POLL_S)
    return status


async def run_checks(preset: Preset, runtime: Any, recorder: Recorder) -> None:
    """The checks after bring-up, in order; raises StepFailed at the first that fails."""
    await check_engines(runtime, recorder)
    await check_rl_step(preset, runtime, recorder)
    await check_watchdog(preset, runtime, recorder)


def before_cells_hook(preset: Preset, recorder: Recorder) -> Callable[[], Any]:
    async def hook() -> None:
        await check_cluster(preset, recorder)

    return hook
