"""`launcher selftest`: prove a preset on this cluster before a long run (no click here: see cli_selftest.py).

It submits the preset with `selftest.enabled=true` (and `nodes=N` when asked): the job comes up on the
preset's real pieces, its driver runs the scripted checks and appends one row per check to
RUN_DIR/selftest.jsonl (miles.contract.selftest), kills its own trainer and the job ends itself. This
module follows the job, passes each row on as it arrives, adds the launcher's own rows (`scheduler`,
`nodes`, `job_end`: derived by the pure functions below from what the scheduler and the run directory
say), and writes RUN_DIR/selftest.json and the run report (RUN_DIR/report.html).

Bounds: the whole self-test gets `timeout` seconds (DEFAULT_TIMEOUT_S, 30 minutes: a queue wait plus a
bring-up; None = no bound), then the job is cancelled and the checks not reported are `not run`. After
the driver's `watchdog` row the job must end itself within `job_end_timeout_s`; after a failed row it
should end by itself too (the driver exits) and is cancelled FAILED_END_GRACE_S later if it does not.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher import api
from launcher.report import ended_at
from launcher.runs import JobRecord, Run
from launcher.schedulers import JobState, SchedulerError, State
from launcher.schedulers.local import read_exit_code
from launcher.waiting import UNKNOWN_LIMIT, Backoff
from miles.contract.exit_codes import JobExit
from miles.contract.preset import PresetError, read_resolved
from miles.contract.roles import RoleError, read_roles_tsv
from miles.contract.selftest import (
    SPECS,
    STEPS,
    SelftestRow,
    append_row,
    complete_table,
    passed,
    read_rows,
)

DEFAULT_TIMEOUT_S = 1800.0  # the whole self-test, queue wait included
JOB_END_TIMEOUT_S = 120.0  # after the trainer is killed, the job must have ended within this
FAILED_END_GRACE_S = 60.0  # after a failed row, the job should end by itself within this
FILE_POLL_S = 1.0
RESULT_FILE = "selftest.json"
REPORT_FILE = "report.html"
JOB_LOG = "logs/job.log"
DRIVER_LOG = "logs/driver.log"
MONITOR_LOG = "logs/monitor.log"
ROLES_FILE = "roles.tsv"
DETAIL_LINE_CHARS = 300
DIE_CONTEXT_LINES = 5  # how far above a `die` the job log's `Error:` line it refers to may be

LAUNCHER_STEPS = tuple(step.name for step in STEPS if step.by == "launcher")
DRIVER_STEPS = tuple(step.name for step in STEPS if step.by == "driver")

RoleRow = tuple[int, str, str, str]  # roles.tsv: (index, name, ip, comma-separated roles)


# ---- pure: the launcher's rows from plain facts ------------------------------------------------------------


@dataclass(frozen=True)
class NodeError:
    """An error line of a node's launch or Ray log; `node` None where the file names no node we know."""

    node: str | None
    log: str  # relative to the run dir
    line: str


def _row(step: str, **fields: Any) -> SelftestRow:
    return SelftestRow(step=step, **fields).with_hint()


def _clip(line: str) -> str:
    line = line.strip()
    return line if len(line) <= DETAIL_LINE_CHARS else line[: DETAIL_LINE_CHARS - 3] + "..."


def _ended_words(ended: JobState) -> str:
    word = ended.raw or ended.state.value
    return f"{word} (exit code {ended.exit_code})" if ended.exit_code is not None else word


def scheduler_row(
    *,
    ran: bool,
    ended: JobState | None,
    queue_s: float | None = None,
    log: str | None = None,
    log_tail: Sequence[str] = (),
) -> SelftestRow | None:
    """`scheduler`: pass once the job ran (seconds: its queue wait, when known); fail when it ended without
    running (the scheduler's word and the job log's last line as the detail); None while it waits."""
    if ran:
        waited = f" after {queue_s:.0f} s in the queue" if queue_s is not None else ""
        return _row("scheduler", status="pass", seconds=queue_s, detail=f"the job started{waited}")
    if ended is None:
        return None
    last = next((line for line in reversed(log_tail) if line.strip()), None)
    detail = f"the job ended {_ended_words(ended)} without running" + (f": {_clip(last)}" if last else "")
    return _row("scheduler", status="fail", detail=detail, log=log)


def node_of_log(log_name: str, roles: Sequence[RoleRow] | None) -> str | None:
    """The node a per-node log belongs to: ray-head.log the head, ray-worker-<i>.log and launch-<i>.log
    the node of role index i (roles.tsv); None where that cannot be told."""
    if not roles:
        return None
    name = Path(log_name).name
    if name == "ray-head.log":
        return next((node for _, node, _, duties in roles if "head" in duties.split(",")), None)
    match = re.fullmatch(r"(?:ray-worker|launch)-(\d+)\.log", name)
    if match is None:
        return None
    index = int(match.group(1))
    return next((node for i, node, _, _ in roles if i == index), None)


def die_line(job_log_lines: Sequence[str]) -> str | None:
    """The message of the job script's last `die` (`... [job] ERROR: message`), after the `Error:` line a
    step printed just before it (a die that says "see above" refers to it)."""
    for index in range(len(job_log_lines) - 1, -1, -1):
        match = re.search(r"\[job\] ERROR: (.*)", job_log_lines[index])
        if not match:
            continue
        message = match.group(1).strip()
        above = job_log_lines[max(0, index - DIE_CONTEXT_LINES) : index]
        cause = next((line.strip() for line in reversed(above) if line.startswith("Error: ")), None)
        return f"{cause.removeprefix('Error: ')} ({message})" if cause else message
    return None


def nodes_row(
    *,
    roles: Sequence[RoleRow] | None,
    expected_nodes: int | None,
    driver_started: bool,
    ended: JobState | None,
    bringup_s: float | None = None,
    job_log_lines: Sequence[str] = (),
    node_errors: Sequence[NodeError] = (),
) -> SelftestRow | None:
    """`nodes`: pass when roles.tsv lists the preset's nodes and the driver started (seconds: from the job
    script's start to the driver's); fail when the job ended before the driver, with the job's `die` line
    and the nodes' error lines (the first node that has one, and its log); None while it comes up."""
    if not driver_started and ended is None:
        return None
    if driver_started and roles is not None and (expected_nodes is None or len(roles) == expected_nodes):
        names = [node for _, node, _, _ in roles]
        head = next((node for _, node, _, duties in roles if "head" in duties.split(",")), None)
        detail = f"{len(names)} node(s): {', '.join(names)}" + (f" (head {head})" if head else "")
        return _row("nodes", status="pass", seconds=bringup_s, detail=detail)
    if driver_started:  # the driver runs, but not on the nodes the preset asked for
        found = "no roles.tsv" if roles is None else f"{len(roles)} node(s) in roles.tsv"
        return _row(
            "nodes",
            status="fail",
            detail=f"the job wrote {found}; the preset asks for {expected_nodes}",
            log=JOB_LOG,
        )
    assert ended is not None
    parts = [die_line(job_log_lines) or f"the job ended {_ended_words(ended)} before the driver started"]
    parts += [f"{error.node or Path(error.log).name}: {_clip(error.line)}" for error in node_errors]
    blamed = next((error for error in node_errors if error.node is not None), None)
    # the job script runs on the head: what it died of happened there unless a node's log says otherwise
    head = next((node for _, node, _, duties in roles or () if "head" in duties.split(",")), None)
    return _row(
        "nodes",
        status="fail",
        detail="; ".join(parts),
        node=blamed.node if blamed else head,
        log=blamed.log if blamed else JOB_LOG,
    )


def killed_at(watchdog: SelftestRow) -> float | None:
    value = watchdog.data.get("killed_at")
    return float(value) if isinstance(value, int | float) else None


def job_end_row(
    *,
    watchdog: SelftestRow | None,
    ended: JobState | None,
    ended_at: float | None,
    now: float,
    watchdog_seen_at: float,
    timeout_s: float = JOB_END_TIMEOUT_S,
) -> SelftestRow | None:
    """`job_end` once the driver's `watchdog` row passed: pass when the job ended with exit code 3
    (TRAINER_DEAD; seconds from the trainer's kill to the job's end), fail on any other end, or when it
    still runs `timeout_s` after the kill (the caller cancels it). None while that is undecided, or when the
    watchdog row did not pass (a `skip` there makes this a skip too)."""
    if watchdog is None or watchdog.status not in ("pass", "skip"):
        return None
    kill = killed_at(watchdog)
    if ended is not None:
        if watchdog.status == "skip":
            return _row(
                "job_end",
                status="skip",
                detail=f"no trainer kill to end on (watchdog skipped); the job ended {_ended_words(ended)}",
            )
        if ended.exit_code == JobExit.TRAINER_DEAD:
            seconds = ended_at - kill if ended_at is not None and kill is not None else None
            after = f" {seconds:.1f} s after the trainer was killed" if seconds is not None else ""
            return _row(
                "job_end",
                status="pass",
                seconds=seconds,
                detail=f"the job ended itself with exit code 3 (trainer dead){after}",
            )
        return _row(
            "job_end",
            status="fail",
            detail=f"the job ended {_ended_words(ended)}, not with exit code 3 (trainer dead)",
            log=JOB_LOG,
        )
    anchor = watchdog_seen_at if kill is None else max(kill, watchdog_seen_at)  # never early on clock skew
    if now - anchor >= timeout_s:
        return _row(
            "job_end",
            status="fail",
            detail=f"the job was still running {timeout_s:.0f} s after the trainer was killed: "
            "the launcher cancelled it",
            log=MONITOR_LOG,
        )
    return None


def lost_driver_row(
    rows: Sequence[SelftestRow], ended: JobState, driver_log_tail: Sequence[str], head: str | None
) -> SelftestRow | None:
    """The job ended while the driver was between rows (no failed row, no `watchdog` row): the check it was
    running (the first driver step without a row) fails, with the driver log's last error line."""
    written = {row.step for row in rows}
    if any(row.status == "fail" for row in rows) or "watchdog" in written:
        return None
    step = next((name for name in DRIVER_STEPS if name not in written), None)
    if step is None:
        return None
    errors = [line for line in driver_log_tail if re.search(r"(?i)error|exception|traceback", line)]
    candidates = errors or [line for line in driver_log_tail if line.strip()]
    last = candidates[-1] if candidates else None
    detail = f"the job ended {_ended_words(ended)} before this check wrote its row"
    return _row(
        step, status="fail", detail=detail + (f": {_clip(last)}" if last else ""), node=head, log=DRIVER_LOG
    )


def queue_seconds(state_times: Mapping[str, str]) -> float | None:
    """SUBMITTED -> RUNNING, from the times the launcher first saw each state (job.json)."""
    try:
        submitted = dt.datetime.fromisoformat(state_times["SUBMITTED"])
        running = dt.datetime.fromisoformat(state_times["RUNNING"])
    except (KeyError, ValueError):
        return None
    return max(0.0, (running - submitted).total_seconds())


def log_time(line: str) -> dt.datetime | None:
    """The time of a job-log line (`YYYY-MM-DD HH:MM:SS [job] ...`)."""
    try:
        return dt.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None


def bringup_seconds(job_log_lines: Sequence[str]) -> float | None:
    """From the job script's first line to its `driver: ...` line (nodes, roles, Ray), by its own clock."""
    times = [(log_time(line), line) for line in job_log_lines if "[job] " in line]
    first = next((t for t, _ in times if t is not None), None)
    driver = next((t for t, line in times if t is not None and "[job] driver: " in line), None)
    return (driver - first).total_seconds() if first and driver else None


# ---- GitHub's heading anchors (the rows' hints point into docs/troubleshooting.md) -------------------------


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped except `-` and `_`, spaces to `-`."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """Every heading anchor of a Markdown page (fenced code skipped; repeats get -1, -2 as on GitHub)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match is None:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


# ---- the run directory's facts -----------------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def read_roles(run_dir: Path) -> list[RoleRow] | None:
    try:
        return read_roles_tsv(run_dir / ROLES_FILE).rows()
    except (OSError, RoleError, ValueError, StopIteration):
        return None  # not written yet, or being written


def expected_nodes(run: Run) -> int | None:
    """The node count the job was submitted with (its resolved preset)."""
    try:
        return read_resolved(run.preset_file).nodes
    except (OSError, PresetError):
        return None


def node_errors(run_dir: Path, roles: Sequence[RoleRow] | None) -> list[NodeError]:
    """`Error: ` lines of logs/ray-*.log (what stopped a node before `ray start`) and error lines of the
    per-node launch logs (srun / pbs_tmrsh), each with its node where roles.tsv tells it."""
    logs = run_dir / "logs"
    found: list[NodeError] = []
    patterns = (("ray-*.log", r"^Error: "), ("launch-*.log", r"(?i)^error\b|\berror:"))
    for glob, pattern in patterns:
        for path in sorted(logs.glob(glob)):
            for line in _lines(path):
                if re.search(pattern, line):
                    rel = f"logs/{path.name}"
                    found.append(NodeError(node_of_log(path.name, roles), rel, line))
    return found


def scheduler_log(run_dir: Path) -> str | None:
    """The job's own log, else the scheduler's output file (slurm-<id>.out, pbs.out), relative."""
    if (run_dir / JOB_LOG).is_file():
        return JOB_LOG
    outs = sorted((run_dir / "logs").glob("*.out"))
    return f"logs/{outs[0].name}" if outs else None


# ---- the result --------------------------------------------------------------------------------------------


@dataclass
class SelftestResult:
    """The self-test's table (every step once, in order), whether it passed, and where to look."""

    run_id: str
    run_dir: str
    scheduler: str
    job_id: str | None
    rows: list[SelftestRow]
    ok: bool
    message: str
    job_state: str | None = None
    job_exit_code: int | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    cancelled: bool = False
    timed_out: bool = False
    result_file: str | None = None
    report_file: str | None = None
    notes: list[str] = field(default_factory=list)  # e.g. why the report could not be written

    @property
    def exit_status(self) -> int:
        return 0 if self.ok else 1

    @property
    def failed(self) -> list[SelftestRow]:
        return [row for row in self.rows if row.status == "fail"]

    def log_path(self, row: SelftestRow) -> str | None:
        """The row's log as a path to open (a relative one is under the run dir)."""
        if not row.log:
            return None
        path = Path(row.log)
        return str(path if path.is_absolute() else Path(self.run_dir) / path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "message": self.message,
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "scheduler": self.scheduler,
            "job_id": self.job_id,
            "job_state": self.job_state,
            "job_exit_code": self.job_exit_code,
            "elapsed_s": round(self.ended_at - self.started_at, 2),
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "rows": [row.model_dump(mode="json") for row in self.rows],
            "result_file": self.result_file,
            "report_file": self.report_file,
            "notes": self.notes,
        }


# ---- following the job -------------------------------------------------------------------------------------


def selftest_overrides(overrides: Mapping[str, object] | Sequence[str], nodes: int | None) -> list[str]:
    """The user's overrides, then the self-test's own (last: they win)."""
    out = [*api.override_strings(overrides), "selftest.enabled=true"]
    return out + ([f"nodes={nodes}"] if nodes is not None else [])


def run_selftest(
    preset: str,
    scheduler: str = "local",
    overrides: Mapping[str, object] | Sequence[str] = (),
    nodes: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    on_row: Callable[[SelftestRow], None] | None = None,
    on_submit: Callable[[api.Job], None] | None = None,
    job_end_timeout_s: float = JOB_END_TIMEOUT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> SelftestResult:
    """Submit the preset as a self-test job, follow it to its end, and return (and write) the table.

    `on_row` gets each row as it arrives (the driver's and the launcher's); `on_submit` the job once it
    is submitted. A refused submit raises as `api.submit` does (PresetError, SubmitRefused,
    SchedulerError); so does a scheduler that stops answering (SCHEDULER_REFUSALS_LIMIT times in a row)."""
    job = api.submit(preset, scheduler=scheduler, overrides=selftest_overrides(overrides, nodes))
    if on_submit is not None:
        on_submit(job)
    return follow_selftest(
        job,
        timeout=timeout,
        on_row=on_row,
        job_end_timeout_s=job_end_timeout_s,
        sleep=sleep,
        clock=clock,
    )


def follow_selftest(
    job: api.Job,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    on_row: Callable[[SelftestRow], None] | None = None,
    job_end_timeout_s: float = JOB_END_TIMEOUT_S,
    backoff: Backoff = Backoff(),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
    write_files: bool = True,
) -> SelftestResult:
    """Follow a submitted self-test job until it ends (or is cancelled); see `run_selftest`."""
    record = job.record
    if record.job_id is None:
        raise api.JobError(f"run {job.run_id} was never submitted (dry run): nothing to follow")
    follower = _Follower(job, record, timeout, on_row, job_end_timeout_s, backoff, sleep, clock)
    result = follower.run()
    if write_files:
        _write_outputs(job.run, result)
    return result


class _Follower:
    def __init__(
        self,
        job: api.Job,
        record: JobRecord,
        timeout: float | None,
        on_row: Callable[[SelftestRow], None] | None,
        job_end_timeout_s: float,
        backoff: Backoff,
        sleep: Callable[[float], None],
        clock: Callable[[], float],
    ):
        self.job, self.record, self.run_dir = job, record, job.run.path
        self.timeout, self.on_row, self.job_end_timeout_s = timeout, on_row, job_end_timeout_s
        self.backoff, self.sleep, self.clock = backoff, sleep, clock
        self.started_at = clock()
        self.rows: list[SelftestRow] = []  # every row passed on, in the order it was
        self._keys: set[tuple[str, str, float]] = set()
        self.state: JobState | None = None  # the scheduler's last answer (UNKNOWN ones left out)
        self.ended: JobState | None = None  # the job's end state, once it ended
        self.ended_at: float | None = None
        self.unknown_in_a_row = 0
        self.watchdog_seen_at: float | None = None
        self.failed_seen_at: float | None = None
        self.cancelled = False
        self.timed_out = False
        self.notes: list[str] = []
        self.expected_nodes = expected_nodes(job.run)

    # -- rows

    def _emit(self, row: SelftestRow, write: bool = False) -> None:
        row = row.with_hint()
        key = (row.step, row.status, row.at)  # a row read back from selftest.jsonl is the same row
        if key in self._keys:
            return
        self._keys.add(key)
        if write:  # the launcher's rows go into selftest.jsonl too, so that file holds the whole table
            try:
                append_row(self.run_dir, row)
            except OSError as exc:
                self.notes.append(f"could not append to selftest.jsonl: {exc}")
        self.rows.append(row)
        if row.status == "fail" and row.step in DRIVER_STEPS and self.failed_seen_at is None:
            self.failed_seen_at = self.clock()  # the driver knows: the job should end by itself now
        if self.on_row is not None:
            self.on_row(row)

    def _has(self, step: str) -> bool:
        return any(row.step == step for row in self.rows)

    def _latest(self, step: str) -> SelftestRow | None:
        return next((row for row in reversed(self.rows) if row.step == step), None)

    # -- one look

    def _poll_scheduler(self) -> None:
        state = api.current_state(self.job.run, self.record)
        if state is None:
            return
        if state.state is State.UNKNOWN:
            self.unknown_in_a_row += 1
            if self.unknown_in_a_row >= UNKNOWN_LIMIT and self.ended is None:  # the scheduler forgot it
                self._end(JobState(State.UNKNOWN, state.raw, read_exit_code(self.run_dir)))
            return
        self.unknown_in_a_row = 0
        self.state = state
        if state.state.finished and self.ended is None:
            self._end(state)

    def _end(self, state: JobState) -> None:
        self.ended = state
        self.ended_at = ended_at(self.job.run, None) or self.clock()  # when it wrote its exit code

    def _look(self) -> None:
        """Read the run dir (after the scheduler: a job seen ended has written all it will); derive rows."""
        run_dir = self.run_dir
        file_rows = read_rows(run_dir)
        roles = read_roles(run_dir)
        job_lines = _lines(run_dir / JOB_LOG)
        driver_rows = [row for row in file_rows if SPECS.get(row.step) is None or row.step in DRIVER_STEPS]
        driver_started = bool(driver_rows) or (run_dir / "phase").exists() or (run_dir / DRIVER_LOG).exists()
        if not self._has("scheduler"):
            record = self.job.record
            ran = (
                "RUNNING" in record.state_times
                or (self.state is not None and self.state.state is State.RUNNING)
                or (run_dir / JOB_LOG).exists()
                or driver_started
            )
            log = scheduler_log(run_dir)
            tail = _lines(run_dir / log)[-5:] if log else []
            row = scheduler_row(
                ran=ran, ended=self.ended, queue_s=queue_seconds(record.state_times), log=log, log_tail=tail
            )
            if row is not None:
                self._emit(row, write=True)
        scheduler = self._latest("scheduler")
        if scheduler is not None and scheduler.status == "pass" and not self._has("nodes"):
            row = nodes_row(
                roles=roles,
                expected_nodes=self.expected_nodes,
                driver_started=driver_started,
                ended=self.ended,
                bringup_s=bringup_seconds(job_lines),
                job_log_lines=job_lines,
                node_errors=node_errors(run_dir, roles) if not driver_started else (),
            )
            if row is not None:
                self._emit(row, write=True)
        if not self._has("nodes"):
            return
        for row in file_rows:
            if row.step not in LAUNCHER_STEPS:
                self._emit(row)
        watchdog = self._latest("watchdog")
        if watchdog is not None and self.watchdog_seen_at is None:
            self.watchdog_seen_at = self.clock()
        if self.ended is not None and not self._has("watchdog"):
            head = next((node for _, node, _, duties in roles or () if "head" in duties.split(",")), None)
            lost = lost_driver_row(self.rows, self.ended, _lines(run_dir / DRIVER_LOG)[-50:], head)
            if lost is not None:
                self._emit(lost, write=True)

    def _judge_end(self) -> None:
        """`job_end` once the watchdog row is in; the cancels the bounds call for."""
        now = self.clock()
        watchdog = self._latest("watchdog")
        if watchdog is not None and self.watchdog_seen_at is not None and not self._has("job_end"):
            row = job_end_row(
                watchdog=watchdog,
                ended=self.ended,
                ended_at=self.ended_at,
                now=now,
                watchdog_seen_at=self.watchdog_seen_at,
                timeout_s=self.job_end_timeout_s,
            )
            if row is not None:
                if self.ended is None:  # still running past its bound
                    self._cancel("it outlived its trainer")
                self._emit(row, write=True)
                return
        failed_at = self.failed_seen_at
        if failed_at is not None and self.ended is None and now - failed_at >= FAILED_END_GRACE_S:
            first = next(row for row in self.rows if row.status == "fail" and row.step in DRIVER_STEPS)
            self._cancel(f"it did not end after the failed `{first.step}` row")
            detail = (
                f"the job was still running {FAILED_END_GRACE_S:.0f} s after the failed `{first.step}` "
                "row: the launcher cancelled it"
            )
            self._emit(_row("job_end", status="fail", detail=detail, log=JOB_LOG), write=True)

    def _cancel(self, why: str) -> None:
        try:
            self.job.cancel()
            self.cancelled = True
            self.notes.append(f"cancelled the job: {why}")
        except (api.JobError, SchedulerError) as exc:
            self.notes.append(f"could not cancel the job ({why}): {exc}")
        try:
            self._poll_scheduler()
        except SchedulerError:
            pass
        if self.ended is None:  # cancelled: the follow ends here, whatever the scheduler says yet
            self._end(JobState(State.CANCELLED, "CANCELLED by the self-test"))

    # -- the loop

    def run(self) -> SelftestResult:
        polls, next_poll, refusals = 0, self.clock(), 0
        seen_rows = 0
        while True:
            now = self.clock()
            if now >= next_poll and self.ended is None:
                try:
                    self._poll_scheduler()
                    refusals = 0
                except SchedulerError:
                    # a busy slurmctld or pbs_server times out now and then: only a run of refusals ends it
                    refusals += 1
                    if refusals >= api.SCHEDULER_REFUSALS_LIMIT:
                        raise
                polls, next_poll = polls + 1, now + self.backoff.delay(polls)
            self._look()
            self._judge_end()
            if len(self.rows) != seen_rows:  # something moved: ask the scheduler again soon
                seen_rows = len(self.rows)
                polls, next_poll = 0, min(next_poll, self.clock() + self.backoff.start_s)
            if self.ended is not None:
                break
            if self.timeout is not None and self.clock() - self.started_at >= self.timeout:
                self.timed_out = True
                self._cancel(f"the self-test's {self.timeout:.0f} s were up")
                break
            self.sleep(max(0.0, min(FILE_POLL_S, next_poll - self.clock())))
        return self._result()

    def _result(self) -> SelftestResult:
        table = complete_table(self.rows)
        ok = passed(self.rows) and not self.timed_out
        end = self.ended or self.state
        return SelftestResult(
            run_id=self.job.run_id,
            run_dir=str(self.run_dir),
            scheduler=self.record.scheduler,
            job_id=self.record.job_id,
            rows=table,
            ok=ok,
            message=self._message(table, ok),
            job_state=end.state.value if end else None,
            job_exit_code=end.exit_code if end else None,
            started_at=self.started_at,
            ended_at=self.clock(),
            cancelled=self.cancelled,
            timed_out=self.timed_out,
            notes=list(self.notes),
        )

    def _message(self, table: list[SelftestRow], ok: bool) -> str:
        counts = {status: sum(row.status == status for row in table) for status in ("pass", "skip")}
        if ok:
            skipped = f" ({counts['skip']} skipped)" if counts["skip"] else ""
            return f"self-test passed: {counts['pass']} of {len(table)} checks{skipped}"
        failed = [row for row in table if row.status == "fail"]
        not_run = sum(row.status == "not run" for row in table)
        if self.timed_out:
            where = f"; `{failed[0].step}` failed" if failed else ""
            return (
                f"self-test timed out after {self.timeout:.0f} s and cancelled the job{where}; "
                f"{not_run} check(s) not run"
            )
        if failed:
            return f"self-test failed at `{failed[0].step}`: {failed[0].detail}"
        end = self.ended
        ended = f"the job ended {_ended_words(end)}" if end else "the job ended"
        return f"self-test incomplete: {ended} with {not_run} check(s) not run"


def _write_outputs(run: Run, result: SelftestResult) -> None:
    """RUN_DIR/selftest.json and the run report (best effort: a report that fails is noted, not fatal)."""
    report = run.path / REPORT_FILE
    try:
        from launcher.report import write_report

        write_report(run, report, None)
        result.report_file = str(report)
    except Exception as exc:  # matplotlib missing or a plot failing must not fail the test
        result.notes.append(f"the run report was not written: {type(exc).__name__}: {exc}")
    target = run.path / RESULT_FILE
    try:
        result.result_file = str(target)
        target.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    except OSError as exc:
        result.result_file = None
        result.notes.append(f"{target} was not written: {exc}")
