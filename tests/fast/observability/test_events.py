"""The run's event log: lines appended by several writers, bounded by rotation, read back in order."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from miles.contract import events
from miles.contract.events import EVENTS_FILE, ROTATED_FILE, EventLog, read_events


def _write_many(run_dir: str, writer: int, count: int) -> None:
    log = EventLog(Path(run_dir), max_bytes=1 << 30)
    for i in range(count):
        log.record("train", writer=writer, i=i, pad="x" * 200)


def test_two_processes_appending_never_interleave_lines(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), w, 300)) for w in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 600
    seen = [json.loads(line) for line in lines]  # every line parses: no torn or mixed writes
    for writer in (1, 2):
        assert [e["i"] for e in seen if e["writer"] == writer] == list(range(300))


def test_the_log_is_bounded_and_keeps_the_newest_events(tmp_path: Path) -> None:
    log = EventLog(tmp_path, max_bytes=4096)
    for i in range(500):
        log.record("train", i=i)
    current, rotated = tmp_path / EVENTS_FILE, tmp_path / ROTATED_FILE
    assert current.stat().st_size <= 4096 and rotated.stat().st_size <= 4096
    got = [e["i"] for e in read_events(tmp_path)]
    assert got[-1] == 499
    assert got == list(range(got[0], 500))  # the rotated file first: oldest to newest, no gap


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.record("phase", phase="ray")
    with (tmp_path / EVENTS_FILE).open("a") as handle:
        handle.write('{"t": 1.0, "kind": "pha')  # a writer killed mid-line
    assert [e["phase"] for e in read_events(tmp_path)] == ["ray"]


def test_record_without_a_configured_log_writes_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MILES_RUN_DIR", raising=False)
    assert events.configure_from_env() is None
    events.record("phase", phase="x")
    monkeypatch.setenv("MILES_RUN_DIR", str(tmp_path))
    events.configure_from_env()
    try:
        events.record("phase", phase="y")
    finally:
        events.configure(None)
    assert [e["phase"] for e in read_events(tmp_path)] == ["y"]


def test_a_tiny_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1024"):
        EventLog(Path("."), max_bytes=10)
