"""CLI commands that talk to a scheduler: submit, runs, status, logs, cancel."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach this module's commands to the top-level group."""
