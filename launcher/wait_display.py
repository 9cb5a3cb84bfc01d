"""What `launcher submit --wait` and `launcher wait` show: the steps as the job comes up, then either how
to reach the gateway or the log that says why it did not come up.

On a terminal a rich live table (a spinner on the current step, elapsed time per step); otherwise, or
with --json (on stderr), one plain line per transition. NO_COLOR turns colour off.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from typing import TextIO
from urllib.parse import urlsplit

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from launcher.api import WaitResult
from launcher.waiting import Outcome, Step

LIVE_REFRESH_PER_S = 4


def transition_line(step: Step, previous: Step | None, first: Step) -> str:
    """`  12.3s  RUNNING  (PENDING 12.3 s)`: time since the wait began, the new step, the last one's time."""
    line = f"{step.started_at - first.started_at:7.1f}s  {step.name}"
    if previous is not None:
        line += f"  ({previous.name} {step.started_at - previous.started_at:.1f} s)"
    return line


class PlainView:
    """One line per transition, for pipes, logs and CI."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self.steps: list[Step] = []

    def on_phase(self, step: Step) -> None:
        previous = self.steps[-1] if self.steps else None
        self.steps.append(step)
        self.write(transition_line(step, previous, self.steps[0]))

    def finish(self, ok: bool) -> None:
        return None  # the outcome lines follow; a plain line per transition is all this view prints

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class LiveView:
    """A live table of the steps, redrawn a few times a second while the wait runs."""

    def __init__(self, console: Console, run_id: str, clock: Callable[[], float] = time.monotonic):
        self.console = console
        self.run_id = run_id
        self.clock = clock
        self.steps: list[Step] = []
        self.failed = False
        self.live = Live(self, console=console, refresh_per_second=LIVE_REFRESH_PER_S, transient=False)

    def on_phase(self, step: Step) -> None:
        self.steps.append(step)

    def finish(self, ok: bool) -> None:
        """Mark the last step as where the job stopped (a red cross) when the wait did not succeed."""
        self.failed = not ok
        self.live.refresh()

    def _mark(self, current: bool, last: bool) -> Spinner | Text:
        if last and self.failed:
            return Text("✗", style="red")
        return Spinner("dots", style="cyan") if current else Text("✓", style="green")

    def __rich__(self) -> Group:
        now = self.clock()
        table = Table(show_header=False, box=None, padding=(0, 1))
        for index, step in enumerate(self.steps):
            last = index == len(self.steps) - 1
            current = last and step.ended_at is None
            mark = self._mark(current, last)
            table.add_row(
                mark, Text(step.name, style="bold" if current else ""), f"{step.elapsed(now):6.1f} s"
            )
        total = now - self.steps[0].started_at if self.steps else 0.0
        return Group(Text(f"waiting for {self.run_id} ({total:.0f} s)", style="dim"), table)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)


def make_console(stream: TextIO | None = None, force_terminal: bool | None = None) -> Console:
    return Console(
        file=stream,
        no_color=bool(os.environ.get("NO_COLOR")),
        highlight=False,
        force_terminal=force_terminal,
        soft_wrap=True,  # a URL, a path or an ssh line is copied whole: never wrapped at the width
    )


def connection_hints(gateway_url: str, api_key_file: str | None, login_host: str) -> dict[str, str]:
    """How to reach a serving job: here (export lines) and from a laptop (an ssh tunnel via this host)."""
    parts = urlsplit(gateway_url)
    host, port = parts.hostname or "localhost", parts.port or (443 if parts.scheme == "https" else 80)
    exports = f"export TINKER_BASE_URL={shlex.quote(gateway_url)}"
    if api_key_file:
        exports += f' TINKER_API_KEY="$(cat {shlex.quote(api_key_file)})"'
    return {
        "gateway_url": gateway_url,
        "api_key_file": api_key_file or "(none in the run directory: see the preset's gateway.api_key)",
        "export": exports,
        "tunnel": f"ssh -N -L {port}:{host}:{port} {login_host}",
        "laptop_base_url": f"{parts.scheme or 'http'}://localhost:{port}",
    }


def serving_lines(result: WaitResult, login_host: str) -> list[str]:
    lines = [f"{result.run_id}: serving after {result.elapsed_s:.1f} s"]
    if result.gateway_url is None:
        return [*lines, "  (the job wrote no gateway URL: see `launcher status`)"]
    hints = connection_hints(result.gateway_url, result.api_key_file, login_host)
    return [
        *lines,
        f"  gateway:      {hints['gateway_url']}",
        f"  API key file: {hints['api_key_file']}",
        f"  {hints['export']}",
        f"  from a laptop: {hints['tunnel']}   (then TINKER_BASE_URL={hints['laptop_base_url']})",
    ]


def failure_lines(result: WaitResult) -> list[str]:
    code = f", job exit code {result.job_exit_code}" if result.job_exit_code is not None else ""
    head = f"{result.run_id}: {result.outcome.value} after {result.elapsed_s:.1f} s{code}"
    if result.outcome is Outcome.WAIT_TIMEOUT:
        head += f" (the job goes on: `launcher wait {result.run_id}` or `launcher cancel {result.run_id}`)"
    if not result.failing_component:
        return [head, "  (no log written)"]
    component = result.failing_component
    return [
        head,
        f"last {len(result.log_tail)} lines of the {component} log "
        f"(`launcher logs {result.run_id} -c {component}` for all of it):",
        *(f"  {line}" for line in result.log_tail),
    ]
