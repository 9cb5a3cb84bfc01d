"""`launcher doctor`: run the preflight checks of `launcher.doctor` and print one line (and a fix) each."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from launcher import doctor
from launcher.defaults import load_user_preset
from launcher.doctor import FAIL, Check
from launcher.runs import runs_base_dir
from launcher.schedulers import SCHEDULER_NAMES

MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def run_checks(
    preset_ref: str | None, overrides: tuple[str, ...], scheduler: str | None, python: str
) -> list[Check]:
    env = os.environ
    preset = load_user_preset(preset_ref, overrides, env=env) if preset_ref else None
    schedulers = [scheduler] if scheduler else doctor.detect_schedulers(env)
    checks = [Check("launcher", doctor.OK, f"miles-hpc {doctor.installed_version()} ({sys.executable})")]
    if not schedulers:
        missing = "neither qsub (PBS) nor sbatch (Slurm) found"
        checks.append(
            Check("scheduler", FAIL, missing, "load the scheduler's module, or pass --scheduler local")
        )
    checks += [doctor.check_scheduler(name, env) for name in schedulers]
    checks.append(doctor.check_run_dir(runs_base_dir(env), schedulers, _read("/proc/mounts")))
    checks.append(doctor.check_job_python(python, preset))
    checks.append(doctor.check_preset(preset, schedulers))
    checks.append(doctor.check_model(preset, env))
    checks.append(doctor.check_ports(preset, _read("/proc/sys/net/ipv4/ip_local_port_range")))
    checks.append(doctor.check_bash())
    return checks


@click.command("doctor")
@click.option(
    "--preset", "-p", "preset_ref", default=None, help="Also check this preset (its model, engine, ports)."
)
@click.option(
    "--scheduler", type=click.Choice(SCHEDULER_NAMES), default=None, help="Check only this scheduler."
)
@click.option(
    "--python", default=sys.executable, show_default=True, help="The Python the job script will run."
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of checks.")
def doctor_command(
    preset_ref: str | None, scheduler: str | None, python: str, overrides: tuple[str, ...], as_json: bool
) -> None:
    """Check this login node before a submit; exit status 0 only when no check fails."""
    if overrides and not preset_ref:
        raise click.UsageError("--set needs --preset")
    checks = run_checks(preset_ref, overrides, scheduler, python)
    if as_json:
        click.echo(json.dumps([check.to_dict() for check in checks], indent=2))
    else:
        for check in checks:
            fix = f"  -> {check.fix}" if check.fix and check.status != "ok" else ""
            click.echo(f"[{MARKS[check.status]}] {check.name}: {check.detail}{fix}")
    raise click.exceptions.Exit(doctor.exit_status(checks))


def register(group: click.Group) -> None:
    group.add_command(doctor_command)
