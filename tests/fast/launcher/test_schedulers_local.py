"""The local scheduler on real process groups."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from launcher.schedulers.base import State
from launcher.schedulers.local import LocalScheduler, state_of


def _wait_finished(sched: LocalScheduler, job_id: str, timeout_s: float = 20) -> State:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = sched.status(job_id).state
        if state.finished:
            return state
        time.sleep(0.05)
    raise AssertionError("local job did not finish")


def _script(run_dir: Path, body: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "job.sh"
    script.write_text("#!/bin/bash\n" + body)
    return script


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def test_exit_code_and_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = _script(run_dir, 'echo "hello from $MILES_RUN_DIR"; exit 7\n')
    sched = LocalScheduler()
    job_id = sched.submit(script, run_dir)
    assert _wait_finished(sched, job_id) == State.FAILED
    assert sched.status(job_id).exit_code == 7
    assert f"hello from {run_dir.resolve()}" in (run_dir / "logs" / "job.log").read_text()
    # a fresh scheduler object (another CLI call) finds the job from the run dir alone
    assert LocalScheduler(run_dir=run_dir).status(job_id).state == State.FAILED


def test_success(tmp_path: Path) -> None:
    run_dir = tmp_path / "ok"
    sched = LocalScheduler()
    job_id = sched.submit(_script(run_dir, "true\n"), run_dir)
    assert _wait_finished(sched, job_id) == State.COMPLETED


def test_cancel_stops_the_whole_group_even_a_term_ignoring_child(tmp_path: Path) -> None:
    run_dir = tmp_path / "long"
    body = "sleep 300 &\n(trap '' TERM; sleep 300) &\necho started > \"$MILES_RUN_DIR/started\"\nwait\n"
    sched = LocalScheduler(grace_s=1.0)
    job_id = sched.submit(_script(run_dir, body), run_dir)
    deadline = time.monotonic() + 20
    while not (run_dir / "started").exists():
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.05)
    assert sched.status(job_id).state == State.RUNNING
    pgid = int(job_id)
    assert os.getpgid(pgid) == pgid and len(_group_members(pgid)) >= 3
    sched.cancel(job_id)
    assert _group_members(pgid) == []
    assert sched.status(job_id).state == State.CANCELLED


def test_wrong_job_id_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "x"
    sched = LocalScheduler()
    sched.submit(_script(run_dir, "true\n"), run_dir)
    with pytest.raises(Exception, match="is not the job"):
        sched.status("1")


@pytest.mark.parametrize(
    ("alive", "exit_code", "cancelled", "state"),
    [
        (True, None, False, State.RUNNING),
        (False, 0, False, State.COMPLETED),
        (False, 3, False, State.FAILED),
        (False, None, False, State.FAILED),
        (False, 143, True, State.CANCELLED),
    ],
)
def test_state_table(alive: bool, exit_code: int | None, cancelled: bool, state: State) -> None:
    assert state_of(alive, exit_code, cancelled).state == state


def test_signal_exit_recorded_as_128_plus(tmp_path: Path) -> None:
    run_dir = tmp_path / "sig"
    sched = LocalScheduler()
    job_id = sched.submit(_script(run_dir, "kill -KILL $$\n"), run_dir)
    _wait_finished(sched, job_id)
    assert sched.status(job_id).exit_code == 128 + signal.SIGKILL
