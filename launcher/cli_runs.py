"""`launcher runs`: the run directories, filtered by state or preset, here or across the user's runs dirs.

Run ids are never cut: a terminal gets a table whose run column is as wide as the longest id (the other
columns fold), and a pipe gets plain aligned columns without any width limit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence

import click
from rich.console import Console
from rich.table import Table

from launcher import api
from launcher.runs import JobRecord

COLUMNS = ("run", "preset", "scheduler", "job", "last state", "submitted")


def rows(records: Iterable[JobRecord]) -> list[tuple[str, ...]]:
    return [
        (r.run_id, r.preset, r.scheduler, r.job_id or "-", r.state, r.submitted_at or "-") for r in records
    ]


def plain_lines(table_rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell, two spaces apart: no width limit, nothing cut."""
    widths = [max(len(cell) for cell in column) for column in zip(COLUMNS, *table_rows, strict=False)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (COLUMNS, *table_rows)
    ]


# Beside the run column, a table needs room for the other five columns (folded to a few characters each)
# and its borders; in a terminal narrower than that, plain lines (which the terminal wraps) keep ids whole.
OTHER_COLUMNS_MIN_WIDTH = 40


def for_terminal(table_rows: Sequence[tuple[str, ...]], width: int) -> Table | str:
    """A table if the terminal is wide enough for whole run ids in one, else plain aligned lines."""
    longest = max((len(row[0]) for row in table_rows), default=0)
    if longest + OTHER_COLUMNS_MIN_WIDTH > width:
        return "\n".join(plain_lines(table_rows))
    return rich_table(table_rows)


def rich_table(table_rows: Sequence[tuple[str, ...]]) -> Table:
    """A terminal table whose run column never shrinks below the longest run id."""
    table = Table()
    longest = max((len(row[0]) for row in table_rows), default=len(COLUMNS[0]))
    table.add_column(COLUMNS[0], no_wrap=True, min_width=longest)
    for name in COLUMNS[1:]:
        table.add_column(name, overflow="fold")
    for row in table_rows:
        table.add_row(*row)
    return table


@click.command(name="runs")
@click.option(
    "--state", "states", multiple=True, metavar="STATE", help="Only runs last seen in STATE (repeatable)."
)
@click.option(
    "--preset", "presets", multiple=True, metavar="NAME", help="Only runs of preset NAME (repeatable)."
)
@click.option(
    "--all", "everywhere", is_flag=True, help="Also the run directories listed in the defaults file."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def runs_command(states: tuple[str, ...], presets: tuple[str, ...], everywhere: bool, as_json: bool) -> None:
    """List runs, oldest first, with the last state seen (`launcher status RUN` asks the scheduler)."""
    records = [job.record for job in api.runs(states=states, presets=presets, everywhere=everywhere)]
    if as_json:
        click.echo(json.dumps([r.model_dump() for r in records], indent=2, default=str))
    elif sys.stdout.isatty():
        console = Console()
        shown = for_terminal(rows(records), console.width)
        if isinstance(shown, str):
            click.echo(shown)
        else:
            console.print(shown)
    else:
        click.echo("\n".join(plain_lines(rows(records))))


def register(group: click.Group) -> None:
    """Attach `runs` (it replaces any earlier `runs` command of the group)."""
    group.add_command(runs_command)
