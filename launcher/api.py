"""The Python API for jobs: what `launcher submit/status/wait/logs/cancel/runs` do, for notebooks and scripts.

    from launcher import api

    job = api.submit("tiny-cpu", scheduler="local", overrides={"watchdog.dead_probes": 2})
    job.wait(timeout=600)                      # until healthz answers 200; raises WaitFailed otherwise
    service = job.tinker_service_client()      # a ready tinker.ServiceClient
    job.cancel()

    result = api.selftest("tiny-cpu", scheduler="local")  # prove a preset: a short job checks every piece
    print(result.ok, [(row.step, row.status) for row in result.rows])  # also in RUN_DIR/selftest.json

The CLI is a thin layer over these functions. Errors are typed: PresetError (the preset or an
override), RunLookupError (no such run), SchedulerError (qsub/sbatch/... said no), JobError and its
subclasses (this module's own refusals, with a hint); writing the run directory may also raise OSError
or a jinja2.TemplateError. `API_ERRORS` lists the first four. Nothing here imports torch, ray or
transformers; tinker only when a client is asked for.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.run_state import (
    END_REASON_FILE,
    HEALTHY_FILE,
    HEALTHZ_PATH,
    PHASE_FILE,
    PORTS_DIR,
    api_key_file,
    api_key_source,
    current_state,
    gateway_tls_cert,
    healthz_url,
    phase_of,
    probe_healthz,
)
from launcher.runs import (
    NOT_SUBMITTED,
    JobRecord,
    LogTail,
    Run,
    RunLookupError,
    component_of,
    create_run,
    find_run,
    list_runs,
    record_state,
    record_submission,
    runs_base_dir,
)
from launcher.schedulers import JobState, SchedulerError, State, get_scheduler
from launcher.trace import TraceError, fetch_job_trace
from launcher.waiting import (
    SERVING_STEP,
    Backoff,
    Observation,
    Outcome,
    Step,
    WaitTracker,
    exit_status,
    failing_component,
    succeeded,
)
from miles.contract.ports import read_port_files
from miles.contract.preset import PresetError

if TYPE_CHECKING:
    import tinker

    from launcher.selftest import SelftestResult
    from miles.contract.selftest import SelftestRow

FILE_POLL_S = 1.0  # the run directory's small files are cheap to read; the scheduler is polled with backoff
FOLLOW_POLL_S = 0.5
FAILURE_TAIL_LINES = 20
DRY_RUN_HINT = "submit it for real: `launcher submit --preset P` without --dry-run"
SCHEDULER_REFUSALS_LIMIT = 4  # scheduler questions in a row that may fail before a wait gives up


class JobError(RuntimeError):
    """A job operation that cannot be done; the message says why, the hint (if any) what to do."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class SubmitRefused(JobError):
    """The preset would only fail once the nodes are granted: nothing was submitted."""


class NotServing(JobError):
    """The job has no gateway to talk to (yet)."""


API_ERRORS: tuple[type[Exception], ...] = (PresetError, RunLookupError, SchedulerError, JobError)


@dataclass(frozen=True)
class JobStatus:
    """`launcher status`: the scheduler's state, the driver's phase, the gateway and its health."""

    run_id: str
    run_dir: str
    scheduler: str
    job_id: str | None
    state: str
    scheduler_state: str | None
    exit_code: int | None
    phase: str | None
    gateway_url: str | None
    healthz: dict[str, object] | None
    api_key_file: str | None
    ports: dict[str, Any]
    end_reason: str | None
    state_times: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CancelResult:
    run_id: str
    job_id: str | None
    cancelled: bool  # False: it had already ended
    state: str | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class WaitResult:
    """How a wait ended: the outcome, the steps with their times, and the log that says why if it failed."""

    run_id: str
    outcome: Outcome
    until_serving: bool
    job_exit_code: int | None
    steps: list[Step]
    started_at: float
    ended_at: float
    gateway_url: str | None = None
    api_key_file: str | None = None
    failing_component: str | None = None
    log_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return succeeded(self.outcome, self.until_serving)

    @property
    def exit_status(self) -> int:
        return exit_status(self.outcome, self.until_serving, self.job_exit_code)

    @property
    def elapsed_s(self) -> float:
        return self.ended_at - self.started_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "outcome": self.outcome.value,
            "exit_status": self.exit_status,
            "job_exit_code": self.job_exit_code,
            "elapsed_s": round(self.elapsed_s, 2),
            "steps": [{"name": s.name, "elapsed_s": round(s.elapsed(self.ended_at), 2)} for s in self.steps],
            "gateway_url": self.gateway_url,
            "api_key_file": self.api_key_file,
            "failing_component": self.failing_component,
            "log_tail": self.log_tail,
        }


class WaitFailed(JobError):
    """`Job.wait` ended without the job serving (or, with serving=False, without it completing)."""

    def __init__(self, result: WaitResult):
        self.result = result
        where = f"; last lines of its {result.failing_component} log:\n" if result.log_tail else ""
        super().__init__(
            f"run {result.run_id}: {result.outcome.value} after {result.elapsed_s:.0f} s "
            f"(job exit code {result.job_exit_code}){where}" + "\n".join(result.log_tail)
        )


class Job:
    """One run directory and its job. `Job.load(run_id)` reattaches to a run made earlier."""

    def __init__(self, run: Run, warnings: Sequence[str] = ()):
        self.run = run
        self.warnings = list(warnings)  # what a real submit would refuse (dry runs only)

    def __repr__(self) -> str:
        return f"Job({self.run_id!r})"

    @classmethod
    def load(cls, ref: str) -> Job:
        """A run by id, unique id prefix, or run-directory path."""
        return cls(find_run(ref))

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @property
    def record(self) -> JobRecord:
        return self.run.load()

    @property
    def gateway_url(self) -> str | None:
        """The gateway's base URL once the job has written it (None before)."""
        url = healthz_url(self.run)
        return url.removesuffix(HEALTHZ_PATH) if url else None

    @property
    def api_key_file(self) -> str | None:
        return api_key_file(self.run)

    @property
    def api_key(self) -> str | None:
        """The gateway's key: from the preset's key file or variable, or the one the job generated."""
        env_name = api_key_source(self.run).get("env")
        if env_name:
            return os.environ.get(env_name)
        path = self.api_key_file
        try:
            return Path(path).read_text().strip() if path else None
        except OSError:
            return None

    def trace(self, out: Path | None = None) -> dict[str, Any]:
        """Write the serving job's trace (launcher/trace.py) to `out` (default the run directory's
        trace.json); {path, sessions, spans}."""
        url, key = self.gateway_url, self.api_key
        if url is None or key is None:
            raise JobError(
                f"run {self.run.run_id} has no gateway address or API key yet",
                "`launcher wait RUN` until it serves, then trace it",
            )
        try:
            document, sessions = fetch_job_trace(url, key, gateway_tls_cert(self.run))
        except TraceError as exc:
            raise JobError(str(exc), "`launcher status RUN` says whether the gateway is up") from exc
        path = Path(out) if out is not None else self.run.path / "trace.json"
        path.write_text(json.dumps(document))
        spans = sum(1 for event in document["traceEvents"] if event.get("ph") == "X")
        return {"path": str(path), "sessions": sessions, "spans": spans}

    def status(self) -> JobStatus:
        record = self.record
        state = current_state(self.run, record)
        url = healthz_url(self.run)
        running = state is not None and state.state is State.RUNNING
        return JobStatus(
            run_id=self.run_id,
            run_dir=str(self.run.path),
            scheduler=record.scheduler,
            job_id=record.job_id,
            state=state.state.value if state else NOT_SUBMITTED,
            scheduler_state=state.raw if state else None,
            exit_code=state.exit_code if state else None,
            phase=phase_of(self.run, state),
            gateway_url=url.removesuffix(HEALTHZ_PATH) if url else None,
            healthz=probe_healthz(url, gateway_tls_cert(self.run)) if running and url else None,
            api_key_file=self.api_key_file,
            ports=read_port_files(self.run.path / PORTS_DIR),
            end_reason=self.run.read_optional(END_REASON_FILE),
            state_times=self.run.load().state_times,
        )

    def cancel(self) -> CancelResult:
        """Cancel the job (local: SIGTERM to its process group, then SIGKILL); a finished job is left be."""
        record = self.record
        if record.job_id is None:
            raise JobError(
                f"run {self.run_id} was never submitted (dry run): nothing to cancel", DRY_RUN_HINT
            )
        before = current_state(self.run, record)
        cancelled = before is not None and not before.state.finished
        if cancelled:
            get_scheduler(record.scheduler, run_dir=self.run.path).cancel(record.job_id)
        after = current_state(self.run, record)
        return CancelResult(self.run_id, record.job_id, cancelled, after.state.value if after else None)

    def log_components(self) -> list[str]:
        return [component_of(f) for f in LogTail(self.run.logs_dir).files()]

    def logs(self, component: str | None = None, tail: int | None = None) -> list[tuple[str, str]]:
        """(component, line) pairs: every log (or one component's), the last `tail` lines of each."""
        return self._log_reader(component, tail).poll(flush=True)

    def follow_logs(
        self,
        component: str | None = None,
        tail: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Iterator[tuple[str, str]]:
        """The logs, then their new lines as they come, until the job ends."""
        reader = self._log_reader(component, tail, must_exist=False)
        yield from reader.poll()
        record = self.record
        while True:
            state = current_state(self.run, record)
            finished = state is None or state.state.finished or state.state is State.UNKNOWN
            yield from reader.poll(flush=finished)
            if finished:
                return
            sleep(FOLLOW_POLL_S)

    def _log_reader(self, component: str | None, tail: int | None, must_exist: bool = True) -> LogTail:
        reader = LogTail(self.run.logs_dir, component)
        if component is not None and must_exist and not reader.files():
            known = ", ".join(self.log_components()) or "none yet"
            raise JobError(
                f"run {self.run_id} has no {component!r} log (components: {known})",
                "a component's log appears when it starts: `launcher wait RUN` follows the bring-up",
            )
        if tail is not None:
            reader.skip_to_last(tail)
        return reader

    def wait(
        self,
        serving: bool = True,
        timeout: float | None = None,
        on_phase: Callable[[Step], None] | None = None,
        check: bool = True,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> WaitResult:
        """Follow the job until it serves (serving=True) or ends; `on_phase` gets each step as it starts.

        Raises WaitFailed when it ends otherwise (check=False returns the result instead)."""
        record = self.record
        if record.job_id is None:
            raise JobError(
                f"run {self.run_id} was never submitted (dry run): nothing to wait for", DRY_RUN_HINT
            )
        tracker = WaitTracker(started_at=clock(), until_serving=serving, timeout_s=timeout)
        polls, next_poll, refusals = 0, clock(), 0
        while tracker.outcome is None:
            now, state = clock(), None
            if now >= next_poll:
                try:
                    state = current_state(self.run, record)
                    refusals = 0
                except SchedulerError:
                    # a busy slurmctld or pbs_server times out now and then: only a run of refusals ends it
                    refusals += 1
                    if refusals >= SCHEDULER_REFUSALS_LIMIT:
                        raise
                polls, next_poll = polls + 1, now + backoff.delay(polls)
            seen = self._observe(state)
            started = tracker.observe(seen, clock())
            for step in started:
                if on_phase is not None:
                    on_phase(step)
            if started and state is None:  # something moved: ask the scheduler again soon
                polls, next_poll = 0, min(next_poll, clock() + backoff.start_s)
            if tracker.outcome is None:
                sleep(max(0.0, min(FILE_POLL_S, next_poll - clock())))
        result = self._wait_result(tracker, clock())
        if check and not result.ok:
            raise WaitFailed(result)
        return result

    def _observe(self, state: JobState | None) -> Observation:
        phase = self.run.read_optional(PHASE_FILE)
        healthy = (self.run.path / HEALTHY_FILE).exists()
        if not healthy and phase == SERVING_STEP:  # the driver serves: healthz says when, before the watchdog
            url = healthz_url(self.run)
            probe = probe_healthz(url, gateway_tls_cert(self.run)) if url else {}
            healthy = probe.get("status_code") == 200
        if state is None:
            return Observation(None, phase, healthy)
        return Observation(state.state, phase, healthy, state.exit_code)

    def _wait_result(self, tracker: WaitTracker, now: float) -> WaitResult:
        assert tracker.outcome is not None
        result = WaitResult(
            run_id=self.run_id,
            outcome=tracker.outcome,
            until_serving=tracker.until_serving,
            job_exit_code=tracker.exit_code,
            steps=tracker.steps,
            started_at=tracker.started_at,
            ended_at=now,
            gateway_url=self.gateway_url,
            api_key_file=self.api_key_file,
        )
        if not result.ok:
            driver_started = self.run.read_optional(PHASE_FILE) is not None
            result.failing_component = failing_component(
                tracker.exit_code, driver_started, self.log_components()
            )
            if result.failing_component:
                lines = self.logs(result.failing_component, tail=FAILURE_TAIL_LINES)
                result.log_tail = [line for _, line in lines]
        return result

    def tinker_service_client(self) -> tinker.ServiceClient:
        """A `tinker.ServiceClient` for this job's gateway, with its key (the job must be serving)."""
        url, key = self.gateway_url, self.api_key
        if url is None or key is None:
            raise NotServing(
                f"run {self.run_id} has no gateway URL or API key yet: wait for it (job.wait()) first",
                f"`launcher wait {self.run_id}` follows the job until it serves",
            )
        try:
            import tinker  # the SDK only where a client is wanted: the launcher itself never needs it
        except ImportError as exc:
            raise JobError(
                "the tinker SDK is not installed here",
                "pip install 'miles-hpc[client]' (the tinker SDK alone), or the runtime extra",
            ) from exc
        return tinker.ServiceClient(base_url=url, api_key=key)


def override_strings(overrides: Mapping[str, object] | Sequence[str]) -> list[str]:
    """`{"a.b": 2}` -> `["a.b=2"]`: values in YAML's words (JSON is YAML), strings as given."""
    if not isinstance(overrides, Mapping):
        return list(overrides)
    out = []
    for key, value in overrides.items():
        out.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    return out


def submit(
    preset: str,
    scheduler: str = "local",
    overrides: Mapping[str, object] | Sequence[str] = (),
    dry_run: bool = False,
    env: Mapping[str, str] | None = None,
) -> Job:
    """Resolve a preset (shipped name or YAML path), write the run directory and job script, submit it.

    A dry run writes everything and submits nothing; what a real submit would refuse is in `job.warnings`."""
    from launcher.defaults import load_user_preset
    from launcher.render import render_job_script
    from launcher.submit_checks import submit_problems
    from miles.contract.preset import preset_to_yaml

    get_scheduler(scheduler)  # an unknown name fails before anything else is looked at
    env = os.environ if env is None else env
    resolved = load_user_preset(preset, override_strings(overrides), env=env)  # with the defaults file
    problems = submit_problems(resolved, env, scheduler)
    if problems and not dry_run:  # refused here, not after the allocation is granted
        raise SubmitRefused(
            "the job would fail at start:\n  " + "\n  ".join(problems),
            "fix the preset or override it (--set KEY=VALUE; overrides={...} in Python)",
        )
    run = create_run(resolved.name, scheduler)
    try:
        run.preset_file.write_text(preset_to_yaml(resolved))
        run.script.write_text(render_job_script(resolved, scheduler, run.path, python=sys.executable))
    except BaseException:  # no half-written run directory; the error itself says what went wrong
        shutil.rmtree(run.path, ignore_errors=True)
        raise
    run.script.chmod(0o755)
    if not dry_run:
        _submit(run, scheduler)
    return Job(run, warnings=problems)


def _submit(run: Run, scheduler: str) -> str:
    from launcher.schedulers.local import LOCAL_JOB_FILE

    sched = get_scheduler(scheduler, run_dir=run.path)
    try:
        job_id = sched.submit(run.script, run.path)
    except SchedulerError as exc:
        record_state(run, "SUBMIT_FAILED")
        raise SchedulerError(f"{exc}\n(run directory kept: {run.path})") from exc
    extra: dict[str, object] = {}
    if scheduler == "local":
        extra = json.loads((run.path / LOCAL_JOB_FILE).read_text())
    record_submission(run, job_id, extra)
    return job_id


def runs(*, states: Sequence[str] = (), presets: Sequence[str] = (), everywhere: bool = False) -> list[Job]:
    """Runs under the runs directory ($MILES_RUNS_DIR, else ./runs) and, with `everywhere`, under the
    directories the defaults file lists (`runs_dirs`); only those last seen in one of `states` and of
    one of `presets` (empty: any). Ordered by run id (oldest first); a damaged or half-written run
    directory is skipped."""
    from launcher.defaults import load_defaults

    bases = [runs_base_dir().resolve()]
    for listed in load_defaults().runs_dirs if everywhere else ():
        if listed.resolve() not in bases:
            bases.append(listed.resolve())
    wanted_states = {state.upper() for state in states}
    found: list[tuple[str, Job]] = []
    for base in bases:
        for run in list_runs(base):
            try:
                record = run.load()
            except (RunLookupError, ValueError):
                continue
            if wanted_states and record.state.upper() not in wanted_states:
                continue
            if presets and record.preset not in presets:
                continue
            found.append((record.run_id, Job(run)))
    return [job for _, job in sorted(found, key=lambda pair: pair[0])]


def selftest(
    preset: str,
    scheduler: str = "local",
    overrides: Mapping[str, object] | Sequence[str] = (),
    nodes: int | None = None,
    timeout: float | None = 1800.0,
    on_row: Callable[[SelftestRow], None] | None = None,
) -> SelftestResult:
    """`launcher selftest`: submit the preset with `selftest.enabled=true` (and `nodes=N`), follow the job
    while its driver checks every piece and ends the job, and return the table (`result.ok`, `result.rows`;
    also written to RUN_DIR/selftest.json). `timeout` bounds the whole test, queue wait included (None: no
    bound); past it the job is cancelled and the checks not reported are `not run`. `on_row` gets each row
    as it arrives. A refused submit raises as `submit` does."""
    from launcher.selftest import run_selftest

    return run_selftest(
        preset, scheduler=scheduler, overrides=overrides, nodes=nodes, timeout=timeout, on_row=on_row
    )
