"""The `launcher` command: a thin click group; each command family lives in its own module."""

from __future__ import annotations

import click

from launcher import cli_jobs, cli_presets


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Turn a PBS Pro or Slurm allocation into a Tinker-compatible training service."""


cli_presets.register(main)
cli_jobs.register(main)


if __name__ == "__main__":
    main()
