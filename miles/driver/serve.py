"""The driver the job script starts on the head node: `python -m miles.driver.serve RUN_DIR/preset.yaml`.

Resolved preset -> Ray -> placement (head last) -> engine cells and trainer cells -> initial weights ->
the gateway. Each phase is logged with its time since start (the bring-up timeline) and written to
`RUN_DIR/phase` for `launcher status`.

When no trainer cell is alive the driver exits non-zero within seconds (the job then ends, before the
watchdog's probes would), unless `GATEWAY_DEAD_PROBES`/`watchdog.dead_probes` is 0: then it keeps
serving 503 so operators can inspect the nodes. SIGTERM/SIGINT (Ctrl-C, scancel, walltime) shut down in
order: gateway, engines, trainers, placement group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from miles.contract import events
from miles.contract.exit_codes import JobExit
from miles.contract.preset import Preset, read_resolved
from miles.observability.metrics import job_metrics
from miles.seam.runtime import SupervisedRuntime

log = logging.getLogger("miles.driver.serve")

EXIT_TRAINER_DEAD = JobExit.TRAINER_DEAD
EXIT_STARTUP_FAILED = JobExit.STARTUP_FAILED
EXIT_SELFTEST_FAILED = JobExit.SELFTEST_FAILED
# After the trainer dies the gateway answers 503 with the reason for this long before the driver exits,
# so clients and the watchdog see why; short enough that the job still ends within seconds.
DEAD_GRACE_S = 3.0
NODE_POLL_S = 15.0  # Ray node liveness for /metrics (a GCS call: not on every trainer probe)
NODE_POLL_TIMEOUT_S = 5.0


class Timeline:
    """Phase marks with seconds since the driver started, in the log and in RUN_DIR/phase."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.started = time.monotonic()
        self.marks: list[tuple[str, float]] = []
        self.details: dict[str, str] = {}  # phase -> what its mark said (the self-test's rows show it)

    def phase(self, name: str, detail: str = "") -> None:
        elapsed = time.monotonic() - self.started
        previous = self.marks[-1] if self.marks else None
        self.marks.append((name, elapsed))
        self.details[name] = detail
        log.info("phase %-10s t+%7.2fs %s", name, elapsed, detail)
        if previous is None:
            job_metrics().enter_phase(name, None, 0.0)
        else:
            job_metrics().enter_phase(name, previous[0], elapsed - previous[1])
        events.record("phase", phase=name, elapsed=round(elapsed, 3), detail=detail)
        with contextlib.suppress(OSError):
            # whole or not at all: `launcher wait` reads it meanwhile, and an empty read looked like no phase
            tmp = self.run_dir / "phase.tmp"
            tmp.write_text(name + "\n")
            os.replace(tmp, self.run_dir / "phase")


async def wait_for_shutdown(
    stop: asyncio.Event, runtime: SupervisedRuntime, preset: Preset, always_exit: bool = False
) -> int:
    """Probe the trainer until it dies or a signal arrives; the exit status of the driver.

    `always_exit` (the self-test): end when the trainer dies even with watchdog.dead_probes 0."""
    interval = preset.runtime.trainer_probe_interval_s
    reported = False
    nodes_seen = time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        if stop.is_set():
            break
        alive = await runtime.probe_trainers(timeout_s=max(interval * 5, 10.0))
        observe_liveness(runtime)
        if time.monotonic() - nodes_seen >= NODE_POLL_S:
            nodes_seen = time.monotonic()
            await observe_nodes()
        if alive:
            continue
        problem = runtime.health_problem()
        if not reported:
            events.record("trainer_dead", problem=problem)
        if preset.watchdog.dead_probes == 0 and not always_exit:
            if not reported:
                log.error("trainer dead (%s); dead_probes=0: serving 503 for inspection", problem)
                reported = True
            continue
        log.error("trainer dead: %s; ending the driver in %.0f s", problem, DEAD_GRACE_S)
        reported = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), DEAD_GRACE_S)
        return EXIT_TRAINER_DEAD
    log.info("shutdown requested")
    return 0


def observe_liveness(runtime: SupervisedRuntime) -> None:
    """Trainer cells' liveness as the last probe left it."""
    for index, alive in runtime.trainer_liveness():
        job_metrics().trainer_alive.labels(str(index)).set(1 if alive else 0)


async def observe_nodes() -> None:
    """How many Ray nodes are alive; bounded, so a GCS that stops answering never stalls the probe loop."""
    from miles.cluster.ray_setup import alive_nodes

    with contextlib.suppress(Exception):
        nodes = await asyncio.wait_for(asyncio.to_thread(alive_nodes), NODE_POLL_TIMEOUT_S)
        job_metrics().nodes_alive.set(len(nodes))


async def run(preset: Preset, run_dir: Path) -> int:
    from miles.driver.bringup import bring_up

    timeline = Timeline(run_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def install_signal_handlers() -> None:
        # again after ray.init, which installs its own SIGTERM handler (sys.exit) in the driver
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    install_signal_handlers()
    selftest = SelftestRun(preset, run_dir) if preset.selftest.enabled else None
    async with contextlib.AsyncExitStack() as stack:  # unwinds in reverse: gateway, engines, trainers, ...
        hook = selftest.before_cells if selftest else None
        bring = asyncio.create_task(bring_up(preset, run_dir, timeline, stack, install_signal_handlers, hook))
        interrupted = asyncio.create_task(stop.wait())
        await asyncio.wait({bring, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if not bring.done():
            log.info("signal during bring-up: stopping what was started")
            bring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await bring
            return 0
        interrupted.cancel()
        if selftest is not None:
            selftest.after_bring_up(timeline, bring.exception())
        runtime = bring.result()  # raises the bring-up failure, after the stack stops what was started
        timeline.phase("serving", f"gateway {preset.gateway.host}:{preset.gateway.port}")
        code: int
        if selftest is not None and not await selftest.checks(runtime):
            code = EXIT_SELFTEST_FAILED
        else:
            code = await wait_for_shutdown(stop, runtime, preset, always_exit=selftest is not None)
        timeline.phase("stopping")
    timeline.phase("stopped", f"exit status {code}")
    return code


class SelftestRun:
    """The self-test's part in the driver's run (miles.driver.selftest): rows before the cells, the
    bring-up's rows, the checks after it."""

    def __init__(self, preset: Preset, run_dir: Path) -> None:
        from miles.driver.selftest import Recorder

        self.preset = preset
        self.recorder = Recorder(run_dir)

    async def before_cells(self) -> None:
        from miles.driver.selftest import check_cluster

        await check_cluster(self.preset, self.recorder)

    def after_bring_up(self, timeline: Timeline, error: BaseException | None) -> None:
        from miles.driver.selftest import StepFailed, bringup_rows

        if isinstance(error, StepFailed) or self.recorder.failed:
            return  # a cluster check failed: its row is written
        now = time.monotonic() - timeline.started
        for row in bringup_rows(timeline.marks, now, error, timeline.details, self.recorder.run_dir):
            self.recorder.write(row)

    async def checks(self, runtime: SupervisedRuntime) -> bool:
        """True when every check passed (the trainer is dead then: the driver ends the job as it would)."""
        from miles.driver.selftest import StepFailed, run_checks

        try:
            await run_checks(self.preset, runtime, self.recorder)
        except StepFailed:
            return False
        return True


def with_job_gateway_port(preset: Preset, env: Mapping[str, str]) -> None:
    """The gateway port the job script picked at start (MILES_GATEWAY_PORT) replaces the preset's."""
    picked = env.get("MILES_GATEWAY_PORT")
    if picked:
        preset.gateway.port = int(picked)
    elif preset.gateway.port is None:
        raise SystemExit("gateway.port is unset and MILES_GATEWAY_PORT is not set: start the driver in a job")


def log_gateway_to(path: Path) -> None:
    """The gateway's own log (requests' errors, uvicorn) in logs/gateway.log: `launcher logs -c gateway`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("miles.gateway", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.driver.serve", description=__doc__.split("\n")[0])
    parser.add_argument(
        "preset", type=Path, help="the resolved preset the launcher wrote (RUN_DIR/preset.yaml)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    preset = read_resolved(args.preset)  # resolved at submit: the environment is not re-read
    with_job_gateway_port(preset, os.environ)
    run_dir = Path(os.environ.get("MILES_RUN_DIR") or args.preset.resolve().parent)
    log_gateway_to(run_dir / "logs" / "gateway.log")
    events.configure(run_dir)
    from miles.gateway.server import run_event_loop  # uvloop: the gateway's HTTP path (docs/gateway.md)

    try:
        code = run_event_loop(run(preset, run_dir))
    except Exception as exc:
        log.exception("driver failed during bring-up")
        events.record("driver_failed", error=f"{type(exc).__name__}: {exc}"[:500])
        code = EXIT_STARTUP_FAILED
    events.record("driver_exit", code=int(code))
    # Everything the driver started is stopped; skip interpreter teardown, where Ray's atexit hook would
    # block on a GCS that the job is stopping at the same time.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
