"""`launcher report RUN [-o report.html] [--png DIR]`: one self-contained HTML page about a run.

Built offline from the run directory alone (nothing asks the scheduler or the gateway): the job record
(job.json), the event log the job appends to (events.jsonl: miles.contract.events), the phase, and
the exit code and end reason the job script writes. It shows a timeline (bring-up phases, weight pushes,
training steps, engine events, the trainer's death and the 503 window, the exit), the loss and tokens/s
per model over time, the gaps between push buckets, and the final state. A running job gets the same
page, up to now. Plots are matplotlib figures inlined as SVG (and written as PNGs with --png).
"""

from __future__ import annotations

import datetime as dt
import html
import io
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from launcher.runs import JobRecord, Run, RunLookupError, find_run
from miles.contract.events import read_events
from miles.contract.exit_codes import EXIT_SIGINT, EXIT_SIGTERM, JobExit

Event = dict[str, Any]
FINISHED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
Series = dict[str, list[tuple[float, float]]]
EXIT_MEANINGS = {int(code): code.name.lower().replace("_", " ") for code in JobExit} | {
    EXIT_SIGTERM: "ended by SIGTERM",
    EXIT_SIGINT: "ended by SIGINT",
}


@dataclass
class RunFacts:
    """What the run directory holds, times in Unix seconds."""

    run_id: str
    record: JobRecord | None
    events: list[Event]
    phase: str | None = None
    exit_code: int | None = None
    end_reason: str | None = None
    ended_at: float | None = None  # when the job script recorded its exit (None: still running)
    generated_at: float = field(default_factory=time.time)

    @property
    def submitted_at(self) -> float | None:
        when = self.record.submitted_at if self.record else None
        return dt.datetime.fromisoformat(when).timestamp() if when else None

    @property
    def start(self) -> float:
        """The submit time (the job script's node and Ray start come before the driver's first event)."""
        first = self.events[0]["t"] if self.events else self.generated_at
        return min(first, self.submitted_at or first)

    @property
    def running(self) -> bool:
        return self.ended_at is None and self.exit_code is None and not self.of_kind("driver_exit")

    @property
    def end(self) -> float:
        """When the job ended; for a running one, now."""
        last = self.events[-1]["t"] if self.events else self.start
        return max(last, self.generated_at if self.running else (self.ended_at or last))

    def rel(self, t: float) -> float:
        return t - self.start

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e["kind"] in kinds]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def collect(run: Run) -> RunFacts:
    try:
        record: JobRecord | None = run.load()
    except (RunLookupError, ValueError):
        record = None
    code_text = run.read_optional("exit_code")
    exit_code = int(code_text) if code_text and code_text.lstrip("-").isdigit() else None
    events = sorted(read_events(run.path), key=lambda e: e["t"])
    return RunFacts(
        run_id=run.run_id,
        record=record,
        events=events,
        phase=run.read_optional("phase"),
        exit_code=exit_code,
        end_reason=run.read_optional("end_reason"),
        ended_at=ended_at(run, record),
    )


def ended_at(run: Run, record: JobRecord | None) -> float | None:
    """The earlier of when the job script wrote its exit code and when the launcher first saw the job
    finished (a copied run directory keeps the second only); None while the job runs."""
    seen = []
    if record is not None and record.state in FINISHED_STATES and record.state in record.state_times:
        seen.append(dt.datetime.fromisoformat(record.state_times[record.state]).timestamp())
    written = _mtime(run.path / "exit_code")
    if written is not None:
        seen.append(written)
    return min(seen, default=None)


# ---- pure: the series the page shows ------------------------------------------------------------------


def phase_spans(facts: RunFacts) -> list[tuple[str, float, float]]:
    """(phase, start, end) in seconds since the run's start; the last phase lasts until the end."""
    marks = [(e["phase"], facts.rel(e["t"])) for e in facts.of_kind("phase")]
    if not marks:  # the job ended before the driver marked a phase: nothing to span
        return []
    if marks[0][1] > 0:  # from the submit: queueing, nodes and Ray start in the job script
        marks.insert(0, ("job start", 0.0))
    ends = [t for _, t in marks[1:]] + [facts.rel(facts.end)]
    return [(name, start, end) for (name, start), end in zip(marks, ends, strict=True)]


def loss_series(facts: RunFacts) -> Series:
    series: Series = defaultdict(list)
    for e in facts.of_kind("train"):
        if e.get("loss") is not None and e.get("command") == "forward_backward":
            series[e["model"]].append((facts.rel(e["t"]), float(e["loss"])))
    return dict(series)


def tokens_per_second_series(facts: RunFacts) -> Series:
    series: Series = defaultdict(list)
    for e in facts.of_kind("train"):
        if e.get("seconds"):
            series[e["model"]].append((facts.rel(e["t"]), e["tokens"] / e["seconds"]))
    return dict(series)


def dead_window(facts: RunFacts) -> tuple[float, float] | None:
    """From the trainer's death (the driver's probe, else the watchdog's first 503) until the job ended
    (else now): the span in which healthz answered 503."""
    marks = facts.of_kind("trainer_dead") or [e for e in facts.of_kind("watchdog") if e.get("status") == 503]
    if not marks:
        return None
    exits = [e["t"] for e in facts.of_kind("driver_exit") if e["t"] >= marks[0]["t"]]
    end = exits[0] if exits else (facts.ended_at or facts.end)  # the gateway stops with the driver
    return facts.rel(marks[0]["t"]), facts.rel(end)


def final_state(facts: RunFacts) -> str:
    if facts.running:
        return f"running (phase {facts.phase or '-'})"
    state = facts.record.state if facts.record else "FINISHED"
    return state if state not in ("PENDING", "RUNNING", "SUBMITTED", "NOT_SUBMITTED") else "FINISHED"


def exit_reason(facts: RunFacts) -> str:
    """The end reason the job wrote (a signal), else what its exit code means, else the driver's exit."""
    parts = []
    if facts.exit_code is not None:
        parts.append(f"exit {facts.exit_code} ({EXIT_MEANINGS.get(facts.exit_code, 'unknown code')})")
    if facts.end_reason:
        parts.append(facts.end_reason)
    died = facts.of_kind("trainer_dead")
    if died:
        problem = (died[0].get("problem") or "no detail").splitlines()[0]  # Ray's cause runs on for lines
        parts.append(f"trainer dead: {problem}")
    return "; ".join(parts) if parts else "still running"


def notable_events(facts: RunFacts) -> list[tuple[float, str, str]]:
    """(seconds, kind, text) for the table under the plots: everything but the per-step events."""
    rows = []
    for e in facts.events:
        text = describe(e)
        if text is not None:
            rows.append((facts.rel(e["t"]), e["kind"], text))
    if facts.ended_at is not None:
        rows.append((facts.rel(facts.ended_at), "job_exit", exit_reason(facts)))
    return rows


def describe(e: Event) -> str | None:
    kind = e["kind"]
    if kind == "phase":
        return f"{e['phase']} {e.get('detail') or ''}".strip()
    if kind == "push":
        text = f"{e['push']} push {e['seconds']:.2f} s"
        if "buckets" in e:
            gap = max(e.get("gaps") or [0.0])
            text += f", {e['buckets']} bucket(s), {e['bytes']} bytes, max gap {gap:.3f} s"
        return text
    if kind == "push_aborted":
        return f"{e['push']} push aborted ({e['reason']}): {e.get('error', '')}"
    if kind == "push_delta":
        return describe_delta(e)
    if kind == "push_digest_mismatch":
        return f"delta push v{e.get('version')}: engine digests differ in {', '.join(e.get('tensors') or [])}"
    if kind == "engine":
        problem = f": {e['problem']}" if e.get("problem") else ""
        return f"engine {e['engine']} {e['old']} -> {e['new']}{problem}"
    if kind == "trainer_dead":
        return f"trainer dead: {e.get('problem')}"
    if kind == "watchdog":
        return f"watchdog: HTTP {e.get('status')} ({e.get('consecutive_503')} consecutive 503s), {e['phase']}"
    if kind in ("driver_exit", "driver_failed"):
        return f"driver exit {e['code']}" if kind == "driver_exit" else f"driver failed: {e.get('error')}"
    return None


def describe_delta(e: Event) -> str:
    """A push while delta pushes are on: a delta push's bytes against a full one's, or why it was full."""
    if e.get("mode") != "send":
        why = e.get("fallback") or e.get("mode")
        return f"full push v{e.get('version')} ({why}), verified {e.get('verified')}"
    ratio = e["dense_bytes"] / max(e["bytes"], 1)
    return (
        f"delta push v{e.get('version')}: {e['bytes']} bytes ({ratio:.1f}x fewer than full), "
        f"density {e.get('density')}, forms {e.get('forms')}, verified {e.get('verified')}"
    )


def delta_summary(facts: RunFacts) -> str | None:
    """The summary row of the delta pushes; None when deltas were off."""
    pushes = facts.of_kind("push_delta")
    if not pushes:
        return None
    sent = [e for e in pushes if e.get("mode") == "send"]
    dense, wire = sum(e["dense_bytes"] for e in sent), sum(e["bytes"] for e in sent)
    mismatches = len(facts.of_kind("push_digest_mismatch"))
    ratio = f", {dense / wire:.1f}x fewer bytes" if wire else ""
    return f"{len(sent)} of {len(pushes)} as deltas{ratio}; {mismatches} digest mismatches"


# ---- figures ------------------------------------------------------------------------------------------

ROWS = ("phases", "pushes", "training", "engines", "health")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in the page: smaller, searchable
    import matplotlib.pyplot as plt

    return plt


def timeline_figure(facts: RunFacts):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.0))
    y = {row: len(ROWS) - 1 - i for i, row in enumerate(ROWS)}
    phase_handles = []
    for i, (name, start, end) in enumerate(phase_spans(facts)):
        colour = plt.get_cmap("tab20")(i % 20)
        phase_handles.append(ax.broken_barh([(start, max(end - start, 0.01))], (y["phases"] - 0.35, 0.7),
                                            color=colour, label=f"{name} {end - start:.1f}s"))  # fmt: skip
    for e in facts.of_kind("push"):
        end = facts.rel(e["t"])
        ax.broken_barh(
            [(end - e["seconds"], max(e["seconds"], 0.01))], (y["pushes"] - 0.3, 0.6), color="#6a4c93"
        )
    for e in facts.of_kind("push_aborted"):
        ax.plot(facts.rel(e["t"]), y["pushes"], "x", color="red", ms=9)
    steps = [facts.rel(e["t"]) for e in facts.of_kind("train")]
    optims = [facts.rel(e["t"]) for e in facts.of_kind("optim")]
    ax.plot(steps, [y["training"] + 0.12] * len(steps), "|", color="#1d3557", ms=12, label="forward_backward")
    ax.plot(optims, [y["training"] - 0.12] * len(optims), "|", color="#e76f51", ms=12, label="optim_step")
    _engine_marks(ax, facts, y["engines"])
    _health_marks(ax, facts, y["health"])
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_ylim(-0.7, len(ROWS) - 0.1)
    ax.set_xlim(0, max(facts.rel(facts.end), 1.0) * 1.02)
    ax.set_xlabel("seconds since submit")
    ax.grid(axis="x", alpha=0.3)
    others = [h for h in ax.get_legend_handles_labels()[0] if h not in phase_handles]
    ax.add_artist(ax.legend(handles=others, loc="lower left", fontsize=7, ncols=4))
    ax.legend(handles=phase_handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7,
              ncols=min(len(phase_handles), 6) or 1, frameon=False)  # fmt: skip
    fig.tight_layout()
    return fig


ENGINE_MARKS = {"failed": ("x", "red"), "starting": ("^", "#f4a261"), "ready": ("o", "#2a9d8f")}


def _engine_marks(ax, facts: RunFacts, row: float) -> None:
    for e in facts.of_kind("engine"):
        marker, colour = ENGINE_MARKS.get(e["new"], (".", "grey"))
        ax.plot(facts.rel(e["t"]), row, marker, color=colour, ms=6)
        if e["new"] == "failed":
            ax.annotate(f"engine {e['engine']} failed", (facts.rel(e["t"]), row), fontsize=7, color="red",
                        xytext=(3, 6), textcoords="offset points")  # fmt: skip


def _health_marks(ax, facts: RunFacts, row: float) -> None:
    window = dead_window(facts)
    if window is not None:
        ax.axvspan(*window, color="red", alpha=0.12, label="healthz 503")
        ax.broken_barh([(window[0], max(window[1] - window[0], 0.01))], (row - 0.3, 0.6), color="#e63946")
    for e in facts.of_kind("trainer_dead"):
        ax.annotate("trainer died", (facts.rel(e["t"]), row), fontsize=8, color="#9d0208",
                    xytext=(-10, 8), textcoords="offset points")  # fmt: skip
    healthy = [facts.rel(e["t"]) for e in facts.of_kind("watchdog") if e.get("status") == 200]
    ax.plot(healthy[:1], [row] * len(healthy[:1]), "^", color="#2a9d8f", ms=7, label="first healthz 200")
    probes = [facts.rel(e["t"]) for e in facts.of_kind("watchdog") if e.get("status") == 503]
    ax.plot(probes, [row] * len(probes), "v", color="black", ms=6, label="watchdog 503")
    if facts.ended_at is not None:
        x = facts.rel(facts.ended_at)
        ax.axvline(x, color="black", lw=1.2)
        signal = f" ({facts.end_reason.split(':')[0]})" if facts.end_reason else ""
        ax.text(x, row + 0.35, f"exit {facts.exit_code}{signal} ", fontsize=8, va="bottom", ha="right")


def series_figure(series: Series, ylabel: str, title: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.0))
    for model, points in sorted(series.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=model[:24])
    if not series:
        ax.text(0.5, 0.5, "no training steps recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("seconds")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def gaps_figure(facts: RunFacts):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.0))
    pushes = [e for e in facts.of_kind("push") if e.get("gaps") is not None]
    for e in pushes:
        gaps = e["gaps"] or [0.0]
        ax.plot([facts.rel(e["t"])] * len(gaps), gaps, "o", color="#6a4c93", ms=4)
    if not pushes:
        ax.text(0.5, 0.5, "no full-weight pushes", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("gaps between push buckets", fontsize=10)
    ax.set_xlabel("seconds (push end)")
    ax.set_ylabel("gap (s)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figures(facts: RunFacts) -> dict[str, Any]:
    return {
        "timeline": timeline_figure(facts),
        "loss": series_figure(loss_series(facts), "mean loss / token", "loss per model"),
        "tokens_per_s": series_figure(tokens_per_second_series(facts), "tokens/s", "training tokens/s"),
        "push_gaps": gaps_figure(facts),
    }


def overview_png(png_dir: Path) -> Path:
    """One picture of the run (the README's): the timeline above loss and tokens/s, from their PNGs."""
    plt = _pyplot()
    top, left, right = (plt.imread(png_dir / f"{n}.png") for n in ("timeline", "loss", "tokens_per_s"))
    fig = plt.figure(figsize=(top.shape[1] / 110, (top.shape[0] + left.shape[0]) / 110), dpi=110)
    grid = fig.add_gridspec(2, 2, height_ratios=[top.shape[0], left.shape[0]], hspace=0, wspace=0)
    for image, spec in ((top, grid[0, :]), (left, grid[1, 0]), (right, grid[1, 1])):
        ax = fig.add_subplot(spec)
        ax.imshow(image)
        ax.axis("off")
    fig.subplots_adjust(0, 0, 1, 1)
    target = png_dir / "overview.png"
    fig.savefig(target, dpi=110)
    return target


def svg_of(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # inline: no XML prolog or doctype


# ---- the page -----------------------------------------------------------------------------------------


def summary_rows(facts: RunFacts) -> list[tuple[str, str]]:
    record = facts.record
    steps = len([e for e in facts.of_kind("train") if e.get("command") == "forward_backward"])
    rows = [
        ("run", facts.run_id),
        ("preset", record.preset if record else "-"),
        ("scheduler / job", f"{record.scheduler} / {record.job_id or '-'}" if record else "-"),
        ("final state", final_state(facts)),
        ("exit reason", exit_reason(facts)),
        ("bring-up", ", ".join(f"{n} {e - s:.1f} s" for n, s, e in phase_spans(facts)) or "-"),
        ("training", f"{steps} forward_backward, {len(facts.of_kind('optim'))} optim_step"),
        ("pushes", f"{len(facts.of_kind('push'))} done, {len(facts.of_kind('push_aborted'))} aborted"),
    ]
    if (deltas := delta_summary(facts)) is not None:
        rows.append(("delta pushes", deltas))
    return rows


def render_html(facts: RunFacts, svgs: dict[str, str]) -> str:
    esc = html.escape
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in summary_rows(facts))
    events = "".join(
        f"<tr><td>{t:.1f}</td><td>{esc(kind)}</td><td>{esc(text)}</td></tr>"
        for t, kind, text in notable_events(facts)
    )
    plots = "".join(f'<figure id="{esc(name)}">{svg}</figure>' for name, svg in svgs.items())
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(facts.generated_at))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>run report {esc(facts.run_id)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ text-align: left; padding: 2px 10px; border-bottom: 1px solid #ddd; vertical-align: top; }}
figure {{ display: inline-block; margin: 0.5em; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>run {esc(facts.run_id)}</h1>
<p>generated {generated} from the run directory</p>
<table id="summary">{summary}</table>
<h2>timeline, loss, tokens/s, push gaps</h2>
{plots}
<h2>events</h2>
<table id="events"><tr><th>t (s)</th><th>kind</th><th>what</th></tr>{events}</table>
</body></html>
"""


def write_report(run: Run, output: Path, png_dir: Path | None) -> RunFacts:
    facts = collect(run)
    figs = figures(facts)
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, fig in figs.items():
            fig.savefig(png_dir / f"{name}.png", dpi=110)
        overview_png(png_dir)
    svgs = {name: svg_of(fig) for name, fig in figs.items()}
    _pyplot().close("all")
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    tmp.write_text(render_html(facts, svgs), encoding="utf-8")
    os.replace(tmp, output)
    return facts


@click.command(name="report")
@click.argument("run_ref", metavar="RUN")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="HTML file to write (default: RUN_DIR/report.html).")  # fmt: skip
@click.option("--png", "png_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write each plot as a PNG into this directory.")  # fmt: skip
def report(run_ref: str, output: Path | None, png_dir: Path | None) -> None:
    """Write a self-contained HTML report of a run (running or finished), from its run directory."""
    try:
        run = find_run(run_ref)
    except RunLookupError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"the report needs matplotlib: pip install matplotlib ({exc})") from exc
    target = output or run.path / "report.html"
    facts = write_report(run, target, png_dir)
    click.echo(f"{target}: {len(facts.events)} events, {final_state(facts)}; {exit_reason(facts)}")


def register(group: click.Group) -> None:
    group.add_command(report)
