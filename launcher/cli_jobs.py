"""CLI commands that talk to a scheduler: submit, wait, status, logs, cancel (`runs` is in cli_runs.py).

A thin layer over `launcher.api`: each command parses, calls the API, and prints (rich) or --json.
The API's typed errors become one clean error line here (`api_errors`), never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from launcher import api
from launcher.catalog_status import catalog_table, fetch_catalog
from launcher.cli_errors import CliError
from launcher.elastic_status import elastic_table
from launcher.run_state import gateway_tls_cert
from launcher.schedulers import SCHEDULER_NAMES
from launcher.wait_display import (
    LiveView,
    PlainView,
    connection_hints,
    failure_lines,
    make_console,
    serving_lines,
)

console = Console()
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
timeout_option = click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
    help="Stop waiting after S seconds (exit 4; the job goes on).",
)  # fmt: skip
EXIT_INTERRUPTED = 130


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@contextlib.contextmanager
def api_errors() -> Iterator[None]:
    """The API's own refusals (JobError) as the CLI's; its other typed errors (PresetError, RunLookupError,
    SchedulerError, ...) go as they are to `cli_errors`, the one place that prints every command's errors."""
    try:
        yield
    except api.JobError as exc:
        raise CliError(str(exc), exc.hint) from exc


def _load(run_ref: str) -> api.Job:
    with api_errors():
        return api.Job.load(run_ref)


@click.command()
@click.option("--preset", "-p", "preset_ref", required=True, help="Shipped preset name or a YAML path.")
@click.option("--scheduler", type=click.Choice(SCHEDULER_NAMES), default="local", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset value.")
@click.option("--dry-run", is_flag=True, help="Make the run directory and script; submit nothing.")
@click.option("--wait", "wait_", is_flag=True, help="Follow the job until it serves (see `launcher wait`).")
@timeout_option
@json_option
def submit(
    preset_ref: str,
    scheduler: str,
    overrides: tuple[str, ...],
    dry_run: bool,
    wait_: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Resolve a preset, write the run directory and job script, and submit it."""
    if dry_run and wait_:
        raise click.UsageError("--wait follows a submitted job: drop --dry-run or --wait")
    with api_errors():
        job = api.submit(preset_ref, scheduler=scheduler, overrides=overrides, dry_run=dry_run)
    for problem in job.warnings:
        click.echo(f"warning: a real submit would refuse this: {problem}", err=True)
    record = job.record
    result = {
        "run_id": job.run_id,
        "run_dir": str(job.run.path),
        "script": str(job.run.script),
        "preset_file": str(job.run.preset_file),
        "scheduler": scheduler,
        "job_id": record.job_id,
        "dry_run": dry_run,
    }
    if wait_ and not as_json:
        _print_submitted(result, next_hint=False)
    if wait_:
        _wait_and_exit(job, timeout, as_json, extra=result)
    if as_json:
        _emit_json(result)
    else:
        _print_submitted(result, next_hint=not dry_run)


def _print_submitted(result: dict[str, Any], next_hint: bool) -> None:
    run_id = result["run_id"]
    say = partial(console.print, soft_wrap=True)  # paths and ids whole, whatever the width
    submitted = f"submitted {result['scheduler']} job {result['job_id']}"
    say(f"[bold]{run_id}[/]: {'wrote (dry run, nothing submitted)' if result['dry_run'] else submitted}")
    say(f"  run dir: {result['run_dir']}")
    say(f"  script:  {result['script']}\n  preset:  {result['preset_file']}")
    if next_hint:
        say(f"  next:    launcher wait {run_id} | launcher status {run_id} | launcher logs -f {run_id}")


@click.command(name="wait")
@click.argument("run_ref", metavar="RUN")
@timeout_option
@json_option
def wait_cmd(run_ref: str, timeout: float | None, as_json: bool) -> None:
    """Follow a job until it serves: exit 0 then; non-zero with the failing log's tail if it ends first."""
    _wait_and_exit(_load(run_ref), timeout, as_json)


def _wait_and_exit(
    job: api.Job, timeout: float | None, as_json: bool, extra: dict[str, Any] | None = None
) -> NoReturn:
    """Run the wait with the live display (terminal) or plain lines, print the outcome, exit with it."""
    progress = make_console(sys.stderr if as_json else None)
    plain = as_json or not progress.is_terminal
    view = (
        PlainView(lambda line: progress.print(line, markup=False))
        if plain
        else LiveView(progress, job.run_id)
    )
    try:
        with view, api_errors():
            result = job.wait(serving=True, timeout=timeout, on_phase=view.on_phase, check=False)
            view.finish(result.ok)
    except KeyboardInterrupt:
        progress.print(f"stopped waiting; the job goes on (`launcher wait {job.run_id}` to follow it again)")
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
    login = socket.getfqdn()
    if as_json:
        data = result.to_dict()
        if result.ok and result.gateway_url:
            data["connect"] = connection_hints(result.gateway_url, result.api_key_file, login)
        _emit_json({**(extra or {}), "wait": data} if extra else data)
    else:
        out = make_console()
        for line in serving_lines(result, login) if result.ok else failure_lines(result):
            out.print(line, markup=False, soft_wrap=True)
    raise click.exceptions.Exit(result.exit_status)


@click.command()
@click.argument("run_ref", metavar="RUN")
@json_option
def status(run_ref: str, as_json: bool) -> None:
    """A run's job state (from the scheduler), phase, and gateway health."""
    job = _load(run_ref)
    with api_errors():
        result = job.status().to_dict()
    catalog = _catalog_of(job, result)
    if as_json:
        _emit_json(result if catalog is None else {**result, "catalog": catalog})
        return
    table = Table(show_header=False, box=None)
    for key, value in result.items():
        table.add_row(f"[bold]{key}[/]", json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)
    if catalog is not None and "snapshot" in catalog:
        console.print(catalog_table(catalog["snapshot"]))
        if catalog["snapshot"].get("elastic"):  # a job with elastic.enabled: lanes and GPU owners
            console.print(elastic_table(catalog["snapshot"]["elastic"]))
    elif catalog is not None:
        console.print(f"catalog: {catalog['error']}", markup=False)


def _catalog_of(job: api.Job, result: dict[str, Any]) -> dict[str, Any] | None:
    """The gateway's catalog while it answers healthz 200 (or why it could not be read); else None."""
    healthz = result.get("healthz") or {}
    if healthz.get("status_code") != 200 or not result.get("gateway_url"):
        return None
    return fetch_catalog(result["gateway_url"], job.api_key, gateway_tls_cert(job.run))


@click.command()
@click.argument("run_ref", metavar="RUN")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--component", "-c", default=None, help="Only this component (job, driver, ray-head, ...).")
@click.option("--tail", "-n", type=click.IntRange(min=0), default=None, metavar="N",
              help="Start with the last N lines of each log.")  # fmt: skip
def logs(run_ref: str, follow: bool, component: str | None, tail: int | None) -> None:
    """Print a run's logs, each line prefixed with its component; -f follows them until the job ends."""
    job = _load(run_ref)
    with api_errors():
        lines = job.follow_logs(component, tail) if follow else iter(job.logs(component, tail))
        for name, line in lines:
            click.echo(f"[{name}] {line}")


@click.command()
@click.argument("run_ref", metavar="RUN")
@json_option
def cancel(run_ref: str, as_json: bool) -> None:
    """Cancel a run's job (local: SIGTERM to its process group, then SIGKILL)."""
    job = _load(run_ref)
    with api_errors():
        result = job.cancel()
    if as_json:
        _emit_json(result.to_dict())
    elif result.cancelled:
        scheduler = job.record.scheduler
        console.print(f"cancelled {scheduler} job {result.job_id} of {job.run_id} (now {result.state})")
    else:
        console.print(f"{job.run_id}: job {result.job_id} had already ended ({result.state})")


@click.command(name="trace")
@click.argument("run_ref", metavar="RUN")
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the trace (default RUN_DIR/trace.json).",
)
@json_option
def trace_cmd(run_ref: str, out: Path | None, as_json: bool) -> None:
    """A serving job's sessions as one trace file for ui.perfetto.dev (every session of the job's key)."""
    job = _load(run_ref)
    with api_errors():
        summary = job.trace(out)
    if as_json:
        _emit_json(summary)
        return
    console.print(
        f"{summary['sessions']} session(s), {summary['spans']} spans -> {summary['path']}; "
        "open it in https://ui.perfetto.dev (nothing is uploaded)"
    )


def register(group: click.Group) -> None:
    """Attach this module's commands to the top-level group."""
    for command in (submit, wait_cmd, status, logs, cancel, trace_cmd):
        group.add_command(command)
