"""CLI commands that need no scheduler: presets list/show/validate, render, roles."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach this module's commands to the top-level group."""
