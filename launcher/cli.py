"""The `launcher` command: a thin click group; each command family lives in its own module."""

from __future__ import annotations

import click

from launcher import cli_doctor, cli_errors, cli_jobs, cli_presets, cli_runs, cli_selftest, report
from launcher.doctor import installed_version


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(installed_version(), prog_name="launcher (miles-hpc)")
def main() -> None:
    """Turn a PBS Pro or Slurm allocation into a Tinker-compatible training service."""


cli_presets.register(main)
cli_jobs.register(main)
cli_selftest.register(main)
report.register(main)
cli_runs.register(main)
cli_doctor.register(main)
cli_errors.install(main)  # last: wraps every command registered above


if __name__ == "__main__":
    main()
