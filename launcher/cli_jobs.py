"""CLI commands that talk to a scheduler: submit, runs, status, logs, cancel."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx
import yaml
from rich.console import Console
from rich.table import Table

from launcher.exit_codes import JobExit
from launcher.ports import read_port_files
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
)
from launcher.schedulers import SCHEDULER_NAMES, JobState, SchedulerError, State, get_scheduler
from launcher.schedulers.local import LOCAL_JOB_FILE, read_exit_code

HEALTHZ_PATH = "/api/v1/healthz"
GATEWAY_URL_FILE = "gateway_url"  # may be written by the job once it knows the head's address
JOB_ENV_FILE = "job.env"  # written by the job script: export NAME=value lines
PHASE_FILE = "phase"  # written by the runtime
HEALTHY_FILE = "healthy"  # written by the watchdog on the first 200
PORTS_DIR = "ports"  # written by the job: head.env, node-<index>.env
END_REASON_FILE = "end_reason"  # written by the job when a signal ended it
GENERATED_KEY_FILE = "api_key"
HEALTHZ_TIMEOUT_S = 3.0
FOLLOW_POLL_S = 0.5

console = Console()
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _open_run(ref: str) -> tuple[Run, JobRecord]:
    try:
        run = find_run(ref)
        return run, run.load()
    except RunLookupError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command()
@click.option("--preset", "-p", "preset_ref", required=True, help="Shipped preset name or a YAML path.")
@click.option("--scheduler", type=click.Choice(SCHEDULER_NAMES), default="local", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset value.")
@click.option("--dry-run", is_flag=True, help="Make the run directory and script; submit nothing.")
@json_option
def submit(preset_ref: str, scheduler: str, overrides: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Resolve a preset, write the run directory and job script, and submit it."""
    from launcher.presets import PresetError, load_preset, preset_to_yaml
    from launcher.render import render_job_script
    from launcher.submit_checks import submit_problems

    try:
        preset = load_preset(preset_ref, overrides, env=os.environ)
    except PresetError as exc:
        raise click.ClickException(str(exc)) from exc
    problems = submit_problems(preset, os.environ, scheduler)
    if problems and not dry_run:  # refused here, not after the allocation is granted
        raise click.ClickException("the job would fail at start:\n  " + "\n  ".join(problems))
    for problem in problems:
        click.echo(f"warning: a real submit would refuse this: {problem}", err=True)
    run = create_run(preset.name, scheduler)
    try:
        run.preset_file.write_text(preset_to_yaml(preset))
        run.script.write_text(render_job_script(preset, scheduler, run.path, python=sys.executable))
    except Exception as exc:
        shutil.rmtree(run.path, ignore_errors=True)
        raise click.ClickException(f"could not render the job script: {exc}") from exc
    run.script.chmod(0o755)
    job_id = None
    if not dry_run:
        job_id = _submit(run, scheduler)
    result = {
        "run_id": run.run_id,
        "run_dir": str(run.path),
        "script": str(run.script),
        "preset_file": str(run.preset_file),
        "scheduler": scheduler,
        "job_id": job_id,
        "dry_run": dry_run,
    }
    if as_json:
        _emit_json(result)
        return
    what = "wrote (dry run, nothing submitted)" if dry_run else f"submitted {scheduler} job {job_id}"
    console.print(f"[bold]{run.run_id}[/]: {what}")
    console.print(f"  run dir: {run.path}\n  script:  {run.script}\n  preset:  {run.preset_file}")
    if not dry_run:
        console.print(f"  next:    launcher status {run.run_id} | launcher logs -f {run.run_id}")


def _submit(run: Run, scheduler: str) -> str:
    sched = get_scheduler(scheduler, run_dir=run.path)
    try:
        job_id = sched.submit(run.script, run.path)
    except SchedulerError as exc:
        record_state(run, "SUBMIT_FAILED")
        raise click.ClickException(f"{exc}\n(run directory kept: {run.path})") from exc
    extra: dict[str, object] = {}
    if scheduler == "local":
        extra = json.loads((run.path / LOCAL_JOB_FILE).read_text())
    record_submission(run, job_id, extra)
    return job_id


@click.command(name="runs")
@json_option
def runs_cmd(as_json: bool) -> None:
    """List run directories, oldest first, with the last state seen."""
    records = [run.load() for run in list_runs()]
    if as_json:
        _emit_json([r.model_dump() for r in records])
        return
    table = Table("run", "preset", "scheduler", "job", "last state", "submitted")
    for r in records:
        table.add_row(r.run_id, r.preset, r.scheduler, r.job_id or "-", r.state, r.submitted_at or "-")
    console.print(table)


def current_state(run: Run, record: JobRecord) -> JobState | None:
    """Ask the scheduler, fill in an exit code the job itself recorded, and remember the state."""
    if record.job_id is None:
        return None
    sched = get_scheduler(record.scheduler, run_dir=run.path)
    try:
        state = sched.status(record.job_id)
    except SchedulerError as exc:
        raise click.ClickException(str(exc)) from exc
    state = _with_recorded_exit(state, read_exit_code(run.path))
    state = _with_end_reason(state, run.read_optional(END_REASON_FILE))
    if state.state is not State.UNKNOWN:
        record_state(run, state.state.value, state.exit_code)
    return state


def _with_recorded_exit(state: JobState, recorded: int | None) -> JobState:
    """Torque-style wrappers report finished jobs without an exit status; the job's own record decides."""
    if not state.state.finished or state.exit_code is not None or recorded is None:
        return state
    if state.state is State.COMPLETED and recorded != 0:
        return JobState(State.FAILED, state.raw, recorded)
    return JobState(state.state, state.raw, recorded)


def _with_end_reason(state: JobState, end_reason: str | None) -> JobState:
    """A job that shut itself down on the scheduler's notice before its time limit (USR1) timed out."""
    notice = end_reason is not None and end_reason.startswith("SIGUSR1")
    if state.state.finished and notice and state.exit_code == JobExit.WALLTIME:
        return JobState(State.TIMEOUT, state.raw, state.exit_code)
    return state


def gateway_url(run: Run) -> str | None:
    """The healthz URL: from what the job wrote (gateway_url, or job.env), else the preset's fixed host."""
    written = run.read_optional(GATEWAY_URL_FILE) or job_env(run).get("MILES_GATEWAY_URL")
    if written:
        return written.rstrip("/").removesuffix(HEALTHZ_PATH) + HEALTHZ_PATH
    try:
        preset = yaml.safe_load(run.preset_file.read_text())
        host, port = preset["gateway"]["host"], preset["gateway"]["port"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    if host in ("0.0.0.0", "::", "") or port is None:
        # binds everywhere, or its port is claimed when the job starts: only the job knows the URL
        return None
    return f"http://{host}:{port}{HEALTHZ_PATH}"


def job_env(run: Run) -> dict[str, str]:
    """The `export NAME=value` lines the job script writes to RUN_DIR/job.env (values %q-quoted)."""
    found: dict[str, str] = {}
    for line in (run.read_optional(JOB_ENV_FILE) or "").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            found[name] = value
    return found


def api_key_file(run: Run) -> str | None:
    try:
        preset = yaml.safe_load(run.preset_file.read_text())
        source = (preset.get("gateway") or {}).get("api_key") or {}
    except (OSError, AttributeError, yaml.YAMLError):
        source = {}
    if source.get("file"):
        return str(Path(source["file"]).expanduser())
    generated = run.path / GENERATED_KEY_FILE
    return str(generated) if generated.exists() else None


def probe_healthz(url: str) -> dict[str, object]:
    try:
        response = httpx.get(url, timeout=HEALTHZ_TIMEOUT_S, trust_env=False)  # never through http_proxy
    except httpx.HTTPError as exc:
        return {"status_code": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"status_code": response.status_code, "body": response.text.strip()[:500]}


def phase_of(run: Run, state: JobState | None) -> str | None:
    written = run.read_optional(PHASE_FILE)
    if written:
        return written
    running = state is not None and state.state is State.RUNNING
    if running and (run.path / HEALTHY_FILE).exists():
        return "serving"
    return "starting" if running else None


@click.command()
@click.argument("run_ref", metavar="RUN")
@json_option
def status(run_ref: str, as_json: bool) -> None:
    """A run's job state (from the scheduler), phase, and gateway health."""
    run, record = _open_run(run_ref)
    state = current_state(run, record)
    url = gateway_url(run)
    running = state is not None and state.state is State.RUNNING
    result = {
        "run_id": run.run_id,
        "run_dir": str(run.path),
        "scheduler": record.scheduler,
        "job_id": record.job_id,
        "state": state.state.value if state else NOT_SUBMITTED,
        "scheduler_state": state.raw if state else None,
        "exit_code": state.exit_code if state else None,
        "phase": phase_of(run, state),
        "gateway_url": url.removesuffix(HEALTHZ_PATH) if url else None,
        "healthz": probe_healthz(url) if running and url else None,
        "api_key_file": api_key_file(run),
        "ports": read_port_files(run.path / PORTS_DIR),
        "end_reason": run.read_optional(END_REASON_FILE),
        "state_times": run.load().state_times,
    }
    if as_json:
        _emit_json(result)
        return
    table = Table(show_header=False, box=None)
    for key, value in result.items():
        table.add_row(f"[bold]{key}[/]", json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)


@click.command()
@click.argument("run_ref", metavar="RUN")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--component", "-c", default=None, help="Only this component (job, driver, ray-head, ...).")
def logs(run_ref: str, follow: bool, component: str | None) -> None:
    """Print a run's logs, each line prefixed with its component."""
    run, record = _open_run(run_ref)
    tail = LogTail(run.logs_dir, component)
    if component is not None and not follow and not tail.files():
        known = ", ".join(component_of(f) for f in LogTail(run.logs_dir).files()) or "none yet"
        raise click.ClickException(f"run {run.run_id} has no {component!r} log (components: {known})")
    _print_lines(tail.poll(flush=not follow))
    if not follow:
        return
    while True:
        state = current_state(run, record)
        finished = state is None or state.state.finished or state.state is State.UNKNOWN
        _print_lines(tail.poll(flush=finished))
        if finished:
            return
        time.sleep(FOLLOW_POLL_S)


def _print_lines(lines: list[tuple[str, str]]) -> None:
    for name, line in lines:
        click.echo(f"[{name}] {line}")


@click.command()
@click.argument("run_ref", metavar="RUN")
@json_option
def cancel(run_ref: str, as_json: bool) -> None:
    """Cancel a run's job (local: SIGTERM to its process group, then SIGKILL)."""
    run, record = _open_run(run_ref)
    if record.job_id is None:
        raise click.ClickException(f"run {run.run_id} was never submitted (dry run): nothing to cancel")
    before = current_state(run, record)
    cancelled = False
    if before is not None and not before.state.finished:
        try:
            get_scheduler(record.scheduler, run_dir=run.path).cancel(record.job_id)
        except SchedulerError as exc:
            raise click.ClickException(str(exc)) from exc
        cancelled = True
    after = current_state(run, record)
    result = {
        "run_id": run.run_id,
        "job_id": record.job_id,
        "cancelled": cancelled,
        "state": after.state.value if after else None,
    }
    if as_json:
        _emit_json(result)
    elif cancelled:
        console.print(
            f"cancelled {record.scheduler} job {record.job_id} of {run.run_id} (now {result['state']})"
        )
    else:
        console.print(f"{run.run_id}: job {record.job_id} had already ended ({result['state']})")


def register(group: click.Group) -> None:
    """Attach this module's commands to the top-level group."""
    for command in (submit, runs_cmd, status, logs, cancel):
        group.add_command(command)
