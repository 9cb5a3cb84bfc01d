"""`launcher selftest`: the CLI of launcher/selftest.py (which submits, follows and judges the self-test job).

A line per row as it arrives, then the whole table and, for each failed row, its node, its log file and
the hint; with --json only the result's JSON on stdout (the row lines go to stderr). Exit 0 when every
check passed or was skipped, 1 otherwise (and 1 for a refused submit, as `launcher submit`).
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from launcher import api
from launcher import selftest as selftest_logic
from launcher.cli_jobs import EXIT_INTERRUPTED, api_errors
from launcher.schedulers import SCHEDULER_NAMES
from launcher.wait_display import make_console
from miles.contract.selftest import SPECS, SelftestRow

STATUS_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "not run": "dim"}
STATUS_MARK = {"pass": "✓", "fail": "✗", "skip": "-", "not run": "·"}


def seconds_text(row: SelftestRow) -> str:
    return f"{row.seconds:.1f} s" if row.seconds is not None else ""


def row_line(row: SelftestRow) -> Text:
    """`✓ scheduler  pass     3.0 s  the job started after 3 s in the queue`."""
    line = Text(f"{STATUS_MARK.get(row.status, '?')} ", style=STATUS_STYLE.get(row.status, ""))
    line.append(f"{row.step:<11} ")
    line.append(f"{row.status:<7}", style=STATUS_STYLE.get(row.status, ""))
    line.append(f" {seconds_text(row):>8}  {row.detail}")
    line.rstrip()
    return line


WIDE_TABLE_COLUMNS = 140  # from this terminal width on, the table also says what each step checks


def result_table(rows: list[SelftestRow], wide: bool = True) -> Table:
    table = Table(title="self-test", title_justify="left")
    table.add_column("step", no_wrap=True)
    if wide:
        table.add_column("checks")
    table.add_column("status", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    table.add_column("detail")
    for row in rows:
        spec = SPECS.get(row.step)
        style = STATUS_STYLE.get(row.status, "")
        title = [spec.title if spec else ""] if wide else []
        table.add_row(row.step, *title, Text(row.status, style=style), seconds_text(row), row.detail)
    return table


def failure_lines(result: selftest_logic.SelftestResult) -> list[str]:
    """Under the table: each failed row's node, log file (a path to open) and hint."""
    lines: list[str] = []
    for row in result.failed:
        lines.append(f"{row.step} failed: {row.detail}")
        lines.append(f"  node: {row.node or '-'}")
        lines.append(f"  log:  {result.log_path(row) or '-'}")
        if row.hint:
            lines.append(f"  hint: {row.hint}")
    return lines


def print_result(out: Console, result: selftest_logic.SelftestResult) -> None:
    out.print(result_table(result.rows, wide=out.width >= WIDE_TABLE_COLUMNS))
    for line in failure_lines(result):
        out.print(line, markup=False)
    for note in result.notes:
        out.print(f"note: {note}", markup=False)
    out.print(Text(result.message, style="bold green" if result.ok else "bold red"))
    where = [f"  run dir: {result.run_dir}"]
    if result.result_file:
        where.append(f"  table:   {result.result_file}")
    if result.report_file:
        where.append(f"  report:  {result.report_file}")
    for line in where:
        out.print(line, markup=False)


@click.command(name="selftest")
@click.option("--preset", "-p", "preset_ref", required=True, help="Shipped preset name or a YAML path.")
@click.option("--scheduler", type=click.Choice(SCHEDULER_NAMES), default="local", show_default=True)
@click.option("--nodes", type=click.IntRange(min=1), default=None, metavar="N",
              help="Test on N nodes (overrides the preset's `nodes`).")  # fmt: skip
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset value.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True),
              default=selftest_logic.DEFAULT_TIMEOUT_S, show_default=True, metavar="S",
              help="Bound on the whole test, queue wait included; then the job is cancelled.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON, nothing else.")
def selftest(
    preset_ref: str,
    scheduler: str,
    nodes: int | None,
    overrides: tuple[str, ...],
    timeout: float,
    as_json: bool,
) -> None:
    """Prove a preset on this cluster: submit a short job that checks every piece and then ends itself.

    Prints a pass/fail row per check (the failing node, its log and a hint); exits 0 only if all passed.
    """
    progress = make_console(sys.stderr) if as_json else make_console()

    def on_submit(job: api.Job) -> None:
        record = job.record
        progress.print(
            f"{job.run_id}: submitted {scheduler} job {record.job_id} (self-test); run dir {job.run_dir}",
            markup=False,
        )

    def on_row(row: SelftestRow) -> None:
        progress.print(row_line(row))

    try:
        with api_errors():
            result = selftest_logic.run_selftest(
                preset_ref,
                scheduler=scheduler,
                overrides=overrides,
                nodes=nodes,
                timeout=timeout,
                on_row=on_row,
                on_submit=on_submit,
            )
    except KeyboardInterrupt:
        progress.print(
            "stopped following the self-test; its job ends by itself (`launcher cancel RUN` ends it now)",
            markup=False,
        )
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print_result(make_console(), result)
    raise click.exceptions.Exit(result.exit_status)


def register(group: click.Group) -> None:
    group.add_command(selftest)
