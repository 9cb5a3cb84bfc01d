from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from launcher.runs import (
    RunLookupError,
    create_run,
    find_run,
    is_run_id,
    list_runs,
    new_run_id,
    record_state,
    record_submission,
    runs_base_dir,
    slug,
)

T0 = dt.datetime(2026, 11, 29, 8, 30, 12, tzinfo=dt.UTC)


def test_run_id_shape_sorts_by_time() -> None:
    first = new_run_id("tiny-cpu", T0, suffix="ab12")
    later = new_run_id("a", T0 + dt.timedelta(seconds=1), suffix="0000")
    assert first == "20261129-083012-tiny-cpu-ab12"
    assert is_run_id(first)
    assert sorted([later, first]) == [first, later]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("presets/My Preset.yaml", "my-preset"), ("../../etc/passwd", "passwd"), ("$(x);", "x"), ("", "run")],
)
def test_slug_is_safe_for_a_directory(name: str, expected: str) -> None:
    assert slug(name) == expected


def test_base_dir_from_env(tmp_path: Path) -> None:
    assert runs_base_dir({"MILES_RUNS_DIR": str(tmp_path / "r")}) == tmp_path / "r"
    assert runs_base_dir({}) == Path("runs").resolve()


def test_create_is_unique_within_one_second(tmp_path: Path) -> None:
    runs = [create_run("tiny-cpu", "local", base=tmp_path, now=T0) for _ in range(5)]
    assert len({r.run_id for r in runs}) == 5
    for run in runs:
        record = run.load()
        assert record.run_id == run.run_id and record.scheduler == "local"
        assert record.state == "NOT_SUBMITTED" and run.logs_dir.is_dir()
        assert Path(record.script) == run.script


def test_submission_and_state_times(tmp_path: Path) -> None:
    run = create_run("p", "slurm", base=tmp_path)
    record_submission(run, "42", {"note": "x"})
    record_state(run, "RUNNING", now=T0)
    record_state(run, "RUNNING", now=T0 + dt.timedelta(seconds=9))
    record = record_state(run, "FAILED", exit_code=3, now=T0 + dt.timedelta(seconds=10))
    assert record.job_id == "42" and record.scheduler_data == {"note": "x"}
    assert record.state == "FAILED" and record.exit_code == 3
    assert record.state_times["RUNNING"] == "2026-11-29T08:30:12+00:00"
    assert set(record.state_times) == {"SUBMITTED", "RUNNING", "FAILED"}
    assert run.load() == record


def test_find_by_prefix_path_and_errors(tmp_path: Path) -> None:
    a = create_run("alpha", "local", base=tmp_path, now=T0)
    b = create_run("beta", "local", base=tmp_path, now=T0 + dt.timedelta(days=1))
    assert [r.run_id for r in list_runs(tmp_path)] == [a.run_id, b.run_id]
    assert find_run(a.run_id, tmp_path) == a
    assert find_run("20261130", tmp_path) == b
    assert find_run(str(a.path), tmp_path).run_id == a.run_id
    with pytest.raises(RunLookupError, match="matches 2 runs"):
        find_run("2026", tmp_path)
    with pytest.raises(RunLookupError, match="no run matches"):
        find_run("1999", tmp_path)
    with pytest.raises(RunLookupError):
        find_run("", tmp_path)
    assert list_runs(tmp_path / "missing") == []


def test_log_tail_incremental_new_files_and_partial_lines(tmp_path: Path) -> None:
    from launcher.runs import LogTail

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "job.log").write_text("a\nb\n")
    tail = LogTail(logs)
    assert tail.poll() == [("job", "a"), ("job", "b")]
    assert tail.poll() == []
    with (logs / "job.log").open("a") as handle:
        handle.write("c\npart")
    (logs / "ray-worker-1.log").write_text("w1\n")
    (logs / "notes.txt").write_text("not a log\n")
    (logs / "slurm-7.out").write_text("from slurm\n")
    assert tail.poll() == [("job", "c"), ("ray-worker-1", "w1"), ("slurm-7", "from slurm")]
    with (logs / "job.log").open("a") as handle:
        handle.write("ial\nlast")
    assert tail.poll() == [("job", "partial")]
    assert tail.poll(flush=True) == [("job", "last")]
    only = LogTail(logs, component="ray-worker-1")
    assert only.poll() == [("ray-worker-1", "w1")]
    assert LogTail(tmp_path / "none").poll() == []
