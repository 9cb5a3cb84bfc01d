"""The run's event log: RUN_DIR/events.jsonl, one JSON object a line, appended as things happen.

Every line has `t` (Unix seconds) and `kind` ("phase", "push", "push_aborted", "train", "optim", "engine",
"trainer_dead", "checkpoint_behind", "watchdog", "exit"); the other keys depend on the kind
(docs/observability.md). The log is bounded: when a line would take it past `max_bytes` it is renamed to
events.1.jsonl (the one before that is dropped) and a new one starts, so a run keeps at most twice
`max_bytes`.

Several processes append (the driver, the watchdog): each line is one `write` on a file opened with
O_APPEND, so lines never interleave. Writing never raises: a full disk must not fail a training step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
ROTATED_FILE = "events.1.jsonl"
DEFAULT_MAX_BYTES = 8 << 20
RUN_DIR_ENV = "MILES_RUN_DIR"


class EventLog:
    def __init__(self, run_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, not {max_bytes}")
        self.path = Path(run_dir) / EVENTS_FILE
        self.rotated = Path(run_dir) / ROTATED_FILE
        self.max_bytes = max_bytes

    def record(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": round(time.time(), 3), "kind": kind, **fields}, default=str) + "\n"
        data = line.encode()
        try:
            self._rotate_if_full(len(data))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("event log %s: %s", self.path, exc)

    def _rotate_if_full(self, adding: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + adding > self.max_bytes:
            os.replace(self.path, self.rotated)


_current: EventLog | None = None


def configure(run_dir: Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> EventLog | None:
    """Where this process's `record` calls go (None: nowhere, e.g. tests and the local server)."""
    global _current
    _current = EventLog(run_dir, max_bytes) if run_dir is not None else None
    return _current


def configure_from_env() -> EventLog | None:
    """The job's run dir ($MILES_RUN_DIR), for processes the job script starts (the watchdog)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return configure(Path(run_dir) if run_dir else None)


def record(kind: str, **fields: Any) -> None:
    """Append one event to the configured log; nothing when none is configured."""
    if _current is not None:
        _current.record(kind, **fields)


def read_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every event the run dir holds, oldest first (the rotated file, then the current one); a line that
    does not parse (a write cut short by a kill) is skipped."""
    for name in (ROTATED_FILE, EVENTS_FILE):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict) and "t" in event and "kind" in event:
                    yield event
