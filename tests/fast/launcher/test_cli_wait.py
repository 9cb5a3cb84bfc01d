"""`launcher wait`, `logs --tail` and the Python API over real local-scheduler jobs whose scripts act out a
bring-up (phase files, logs, a healthz server), through click without a terminal (the plain mode)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher import api
from launcher.cli import main
from launcher.runs import create_run, record_submission
from launcher.schedulers import LocalScheduler, SchedulerError
from launcher.waiting import Backoff


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(base))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    return base


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def local_job(runs_dir: Path, body: str) -> str:
    """A run whose job script is `body`, submitted to the real local scheduler."""
    run = create_run("hand-made", "local", base=runs_dir)
    run.script.write_text('#!/bin/bash\nset -eu\ncd "$MILES_RUN_DIR"\n' + body)
    record_submission(run, LocalScheduler().submit(run.script, run.path))
    return run.run_id


def phases(*names: str) -> str:
    return "".join(
        # as the driver writes it: whole (a reader between truncate and write saw no phase at all)
        f"sleep 0.6; echo {name} > phase.tmp; mv phase.tmp phase; echo 'phase {name}' >> logs/driver.log\n"
        for name in names
    )


def test_wait_follows_the_phases_to_serving_and_says_how_to_connect(runs_dir: Path, healthz: str) -> None:
    body = (
        f'printf "export MILES_GATEWAY_URL=%q\\n" {healthz} > job.env; echo tml-k > api_key\n'
        + phases("ray", "model", "cells", "serving")
        + "sleep 300\n"
    )
    run_id = local_job(runs_dir, body)
    try:
        code, out = invoke("wait", run_id, "--timeout", "60")
        assert code == 0, out
        names = [line.split()[1] for line in out.splitlines() if line.startswith(" ") and "s  " in line[:12]]
        # in bring-up order; a phase shorter than the 1 s between looks at the run dir may pass unseen
        order = ["RUNNING", "ray", "model", "cells", "serving"]
        assert names == sorted(set(names), key=order.index) and names[-1] == "serving", out
        assert len(names) >= 3, out
        port = healthz.rsplit(":", 1)[1]
        assert f"gateway:      {healthz}" in out and f"API key file: {runs_dir / run_id / 'api_key'}" in out
        assert f"export TINKER_BASE_URL={healthz} TINKER_API_KEY=" in out
        assert f"ssh -N -L {port}:127.0.0.1:{port} " in out

        job = api.Job.load(run_id)
        assert (job.gateway_url, job.api_key) == (healthz, "tml-k")
        assert job.status().state == "RUNNING"
    finally:
        invoke("cancel", run_id)


def test_a_job_whose_driver_fails_ends_the_wait_with_its_code_and_log_tail(runs_dir: Path) -> None:
    body = (
        phases("ray", "model")
        + 'for i in $(seq 1 50); do echo "driver line $i" >> logs/driver.log; done\n'
        + "echo 'job: driver exited with status 2' >> logs/job.log\nexit 2\n"
    )
    run_id = local_job(runs_dir, body)
    code, out = invoke("wait", run_id, "--json")
    assert code == 2, out
    data = json.loads(out[out.index("{\n") :])
    assert (data["outcome"], data["exit_status"], data["job_exit_code"]) == ("failed", 2, 2)
    assert data["failing_component"] == "driver"
    assert data["log_tail"] == [f"driver line {i}" for i in range(31, 51)]
    assert "ray" in [s["name"] for s in data["steps"]]

    code, out = invoke("wait", run_id)
    assert code == 2 and "failed after" in out and "  driver line 50" in out and "driver line 30\n" not in out


def test_wait_timeout_leaves_the_job_running(runs_dir: Path) -> None:
    run_id = local_job(runs_dir, phases("ray") + "sleep 300\n")
    try:
        started = time.monotonic()
        code, out = invoke("wait", run_id, "--timeout", "2")
        assert code == 4, out
        assert time.monotonic() - started < 30
        assert "wait-timeout" in out and "the job goes on" in out
        assert api.Job.load(run_id).status().state == "RUNNING"
    finally:
        invoke("cancel", run_id)


def test_a_cancelled_job_ends_the_wait_non_zero(runs_dir: Path) -> None:
    run_id = local_job(runs_dir, phases("ray") + "sleep 300\n")
    job = api.Job.load(run_id)
    threading.Timer(2.0, job.cancel).start()
    with pytest.raises(api.WaitFailed, match="cancelled") as failed:
        job.wait(timeout=60)
    assert failed.value.result.exit_status == 143


def test_logs_tail_and_follow_with_tail(runs_dir: Path) -> None:
    body = (
        'for i in $(seq 1 20); do echo "d$i" >> logs/driver.log; done\n'
        "touch ready; sleep 1.5; echo late >> logs/driver.log; exit 0\n"
    )
    run_id = local_job(runs_dir, body)
    deadline = time.monotonic() + 20
    while not (runs_dir / run_id / "ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, out = invoke("logs", run_id, "-c", "driver", "--tail", "3")
    assert code == 0 and out.splitlines() == ["[driver] d18", "[driver] d19", "[driver] d20"]
    code, out = invoke("logs", run_id, "-c", "driver", "-n", "1", "-f")  # stops by itself at the job's end
    assert code == 0 and out.splitlines() == ["[driver] d20", "[driver] late"]


def test_the_scheduler_is_polled_with_backoff_while_phases_are_read_every_second(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake clock: the job really runs (sleep), and every scheduler question is timed."""
    run_id = local_job(runs_dir, "sleep 300\n")
    job = api.Job.load(run_id)
    now = [0.0]
    asked: list[float] = []
    real_state = api.current_state

    def timed_state(*args: object):
        asked.append(now[0])
        return real_state(*args)

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(api, "current_state", timed_state)
    try:
        result = job.wait(timeout=50, clock=lambda: now[0], sleep=sleep, check=False, backoff=Backoff())
        polled = list(asked)
    finally:
        job.cancel()
    assert result.outcome.value == "wait-timeout"
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(polled)]
    assert gaps[:5] == [1.0, 1.5, 2.25, 3.38, 5.06]  # the run dir is read every second in between
    assert gaps[-2:] == [10.0, 10.0] and max(gaps) == 10.0


def test_a_wait_rides_out_a_few_scheduler_failures_but_not_a_run_of_them(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = local_job(runs_dir, "sleep 300\n")
    job = api.Job.load(run_id)
    real_state = api.current_state
    answers = iter(["refuse", "refuse", "answer", "refuse", "refuse", "refuse", "refuse", "answer"])
    asked = []

    def flaky_state(*args: object):
        answer = next(answers)
        asked.append(answer)
        if answer == "refuse":
            raise SchedulerError("squeue: error: slurm_load_jobs error: Socket timed out")
        return real_state(*args)

    monkeypatch.setattr(api, "current_state", flaky_state)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    try:
        with pytest.raises(SchedulerError, match="Socket timed out"):
            job.wait(timeout=600, clock=lambda: now[0], sleep=sleep)
        assert asked == ["refuse", "refuse", "answer", "refuse", "refuse", "refuse", "refuse"]
    finally:
        monkeypatch.undo()
        job.cancel()
