"""Run directories: `runs/<run-id>/{job.sh, preset.yaml, job.json, logs/}`.

The base directory is `$MILES_RUNS_DIR`, else `./runs`. A run id sorts by submit time and is unique:
`20261129-083012-tiny-cpu-ab12` (UTC time, preset name, random suffix).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, Field

RUNS_DIR_ENV = "MILES_RUNS_DIR"
JOB_FILE = "job.json"
SCRIPT_FILE = "job.sh"
PRESET_FILE = "preset.yaml"
LOGS_DIR = "logs"
NOT_SUBMITTED = "NOT_SUBMITTED"
# What one attempt of a job writes into the run dir; a requeued or rerun job moves these aside at its start
# (into attempts/<time>-<pid>/) so that neither it nor `launcher status` trusts the previous attempt's.
ATTEMPT_FILES = (
    "healthy",
    "phase",
    "exit_code",
    "end_reason",
    "cells.json",
    "gateway_url",
    "roles.tsv",
    "nodes.txt",
    "node-ips",
    "ports",
    "job.env",
    "events.jsonl",
    "events.1.jsonl",
)
_RUN_ID = re.compile(r"^\d{8}-\d{6}-[a-z0-9][a-z0-9-]*-[0-9a-f]{4}$")


class RunLookupError(ValueError):
    """No run, or more than one, matches what the user typed."""


class JobRecord(BaseModel):
    """job.json: what was submitted where, and the states seen since."""

    run_id: str
    run_dir: str
    preset: str
    scheduler: str
    script: str
    job_id: str | None = None
    created_at: str
    submitted_at: str | None = None
    state: str = NOT_SUBMITTED
    state_times: dict[str, str] = Field(default_factory=dict)
    exit_code: int | None = None
    scheduler_data: dict[str, object] = Field(default_factory=dict)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat(timespec="seconds")


def runs_base_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(RUNS_DIR_ENV) or "runs").resolve()


def slug(name: str) -> str:
    """A preset name made safe for a directory name (a path like presets/x.yaml gives `x`)."""
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    cleaned = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")
    return cleaned[:40].strip("-") or "run"


def new_run_id(preset_name: str, now: dt.datetime | None = None, suffix: str | None = None) -> str:
    moment = (now or utc_now()).astimezone(dt.UTC)
    return f"{moment:%Y%m%d-%H%M%S}-{slug(preset_name)}-{suffix or secrets.token_hex(2)}"


@dataclass(frozen=True)
class Run:
    """One run directory."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def job_file(self) -> Path:
        return self.path / JOB_FILE

    @property
    def script(self) -> Path:
        return self.path / SCRIPT_FILE

    @property
    def preset_file(self) -> Path:
        return self.path / PRESET_FILE

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS_DIR

    def load(self) -> JobRecord:
        try:
            return JobRecord.model_validate_json(self.job_file.read_text())
        except OSError as exc:
            raise RunLookupError(f"{self.path} is not a run directory: {exc}") from exc

    def save(self, record: JobRecord) -> None:
        # one temporary file per writer: a `wait` and a `cancel` may record states at the same moment
        tmp = self.job_file.with_suffix(f".json.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.write_text(record.model_dump_json(indent=2) + "\n")
        os.replace(tmp, self.job_file)

    def read_optional(self, name: str) -> str | None:
        """A small file the job or the runtime writes into the run dir (phase, healthy, ...), stripped."""
        try:
            return (self.path / name).read_text().strip()
        except OSError:
            return None


def create_run(
    preset_name: str, scheduler: str, base: Path | None = None, now: dt.datetime | None = None
) -> Run:
    """Make a fresh run directory (with logs/) and its first job.json."""
    base = base or runs_base_dir()
    base.mkdir(parents=True, exist_ok=True)
    moment = now or utc_now()
    for _ in range(20):
        path = base / new_run_id(preset_name, moment)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        break
    else:
        raise RuntimeError(f"could not make a unique run directory under {base}")
    run = Run(path)
    run.logs_dir.mkdir()
    run.save(
        JobRecord(
            run_id=run.run_id,
            run_dir=str(path),
            preset=preset_name,
            scheduler=scheduler,
            script=str(run.script),
            created_at=iso(moment),
        )
    )
    return run


def record_submission(run: Run, job_id: str, scheduler_data: Mapping[str, object] | None = None) -> JobRecord:
    record = run.load()
    now = iso(utc_now())
    record.job_id = job_id
    record.submitted_at = now
    record.state = "SUBMITTED"
    record.state_times.setdefault("SUBMITTED", now)
    record.scheduler_data.update(scheduler_data or {})
    run.save(record)
    return record


def record_state(
    run: Run, state: str, exit_code: int | None = None, now: dt.datetime | None = None
) -> JobRecord:
    """Remember the state seen now; the first time a state is seen is kept."""
    record = run.load()
    before = record.model_dump()
    record.state_times.setdefault(state, iso(now or utc_now()))
    record.state = state
    if exit_code is not None:
        record.exit_code = exit_code
    if record.model_dump() != before:
        run.save(record)
    return record


def list_runs(base: Path | None = None) -> list[Run]:
    """Every run directory under the base, oldest first."""
    base = base or runs_base_dir()
    if not base.is_dir():
        return []
    return sorted((Run(p) for p in base.iterdir() if (p / JOB_FILE).is_file()), key=lambda r: r.run_id)


def find_run(ref: str, base: Path | None = None) -> Run:
    """The run named by a path, a full id, or a unique prefix of an id."""
    as_path = Path(ref)
    if (as_path / JOB_FILE).is_file():
        return Run(as_path.resolve())
    runs = list_runs(base)
    exact = [r for r in runs if r.run_id == ref]
    if exact:
        return exact[0]
    matches = [r for r in runs if r.run_id.startswith(ref)] if ref else []
    if len(matches) == 1:
        return matches[0]
    where = base or runs_base_dir()
    if not matches:
        raise RunLookupError(f"no run matches {ref!r} under {where} (see `launcher runs`)")
    names = ", ".join(r.run_id for r in matches[:5])
    raise RunLookupError(f"{ref!r} matches {len(matches)} runs ({names}...): type more of the run id")


def is_run_id(text: str) -> bool:
    return bool(_RUN_ID.match(text))


LOG_SUFFIXES = (".log", ".out")  # our components' logs; the scheduler's own output (slurm-<id>.out)


def component_of(log_file: Path) -> str:
    return log_file.stem


class LogTail:
    """Reads the run's `logs/<component>.log` files incrementally: whole new lines since the last call.

    Files that appear later (a worker's log, the services log) are picked up on the next call; a line
    still being written (no newline yet) waits for its end, unless `flush` is asked for.
    """

    def __init__(self, logs_dir: Path, component: str | None = None):
        self.logs_dir = logs_dir
        self.component = component
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def files(self) -> list[Path]:
        if not self.logs_dir.is_dir():
            return []
        found = sorted(p for p in self.logs_dir.iterdir() if p.suffix in LOG_SUFFIXES and p.is_file())
        if self.component is not None:
            found = [f for f in found if component_of(f) == self.component]
        return found

    def skip_to_last(self, lines: int) -> None:
        """Start each file's next poll at its last `lines` lines (`logs --tail N`), reading only the end."""
        for path in self.files():
            try:
                with path.open("rb") as handle:
                    self._offsets[path] = _start_of_last_lines(handle, lines)
            except OSError:
                continue

    def poll(self, flush: bool = False) -> list[tuple[str, str]]:
        """(component, line) pairs, file by file, each file's lines in order."""
        out: list[tuple[str, str]] = []
        for path in self.files():
            try:
                with path.open("rb") as handle:
                    handle.seek(self._offsets.get(path, 0))
                    chunk = handle.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            lines = data.split(b"\n")
            rest = lines.pop()
            if rest and flush:
                lines.append(rest)
            elif rest:
                self._partial[path] = rest
            name = component_of(path)
            out.extend((name, line.decode("utf-8", "replace")) for line in lines)
        return out


TAIL_BLOCK = 64 * 1024


def _start_of_last_lines(handle: BinaryIO, lines: int) -> int:
    """The offset where the last `lines` lines of a file start (a last line without newline counts)."""
    end = handle.seek(0, os.SEEK_END)
    if lines <= 0:
        return end
    position, newlines = end, 0
    while position > 0:
        size = min(TAIL_BLOCK, position)
        handle.seek(position - size)
        block = handle.read(size)
        if position == end and block.endswith(b"\n"):
            block = block[:-1]  # the file's final newline ends the last line; it starts none
        for index in range(len(block) - 1, -1, -1):
            if block[index] == 0x0A:
                newlines += 1
                if newlines == lines:
                    return position - size + index + 1
        position -= size
    return 0
