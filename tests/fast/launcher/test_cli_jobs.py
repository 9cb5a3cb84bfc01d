"""`launcher submit/runs/status/logs/cancel` through click, with real local-scheduler jobs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.run_state import with_end_reason as _with_end_reason
from launcher.run_state import with_recorded_exit as _with_recorded_exit
from launcher.runs import create_run, list_runs, record_submission
from launcher.schedulers import JobState, LocalScheduler, State


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(base))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    return base


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def test_a_pbs_submit_with_the_placeholder_project_is_refused_and_queues_nothing(runs_dir: Path) -> None:
    tiny = ("--preset", "tiny-cpu", "--scheduler", "pbs")
    code, out = invoke("submit", *tiny, "--set", "scheduler.pbs.project=YOUR_ABCI_GROUP")
    assert code != 0 and "placeholder YOUR_ABCI_GROUP" in out and "--set scheduler.pbs.project=" in out
    assert not runs_dir.exists() or not any(runs_dir.iterdir()), "a refused submit leaves no run"
    code, out = invoke("submit", *tiny, "--set", "scheduler.pbs.project_required=true")
    assert code != 0 and "scheduler.pbs.project is required" in out
    # the other schedulers have no project to check
    code, out = invoke("submit", "--preset", "tiny-cpu", "--scheduler", "slurm", "--dry-run",
                       "--set", "scheduler.pbs.project=YOUR_ABCI_GROUP")  # fmt: skip
    assert code == 0 and "warning" not in out, out


def test_dry_run_json_writes_the_run_dir(runs_dir: Path) -> None:
    code, out = invoke("submit", "--preset", "tiny-cpu", "--scheduler", "local", "--dry-run", "--json")
    assert code == 0, out
    data = json.loads(out)
    run_dir = Path(data["run_dir"])
    assert run_dir.parent == runs_dir and data["run_id"] == run_dir.name
    assert data["scheduler"] == "local" and data["job_id"] is None
    assert Path(data["script"]).read_text().startswith("#!/bin/bash")
    assert "name: tiny-cpu" in (run_dir / "preset.yaml").read_text()
    job = json.loads((run_dir / "job.json").read_text())
    assert job["state"] == "NOT_SUBMITTED" and job["job_id"] is None

    code, out = invoke("runs", "--json")
    assert [r["run_id"] for r in json.loads(out)] == [data["run_id"]]
    code, out = invoke("status", data["run_id"][:15], "--json")
    assert code == 0 and json.loads(out)["state"] == "NOT_SUBMITTED"
    code, out = invoke("cancel", data["run_id"])
    assert code != 0 and "never submitted" in out


def test_set_override_reaches_the_resolved_preset(runs_dir: Path) -> None:
    code, out = invoke("submit", "-p", "tiny-cpu", "--dry-run", "--json", "--set", "watchdog.dead_probes=7")
    assert code == 0, out
    assert "dead_probes: 7" in Path(json.loads(out)["preset_file"]).read_text()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--preset", "no-such-preset"], {}, "unknown preset"),
        (["--preset", "tiny-cpu", "--set", "watchdog.bogus=1"], {}, "bogus"),
        (["--preset", "tiny-cpu"], {"GATEWAY_DEAD_PROBES": "08"}, "GATEWAY_DEAD_PROBES"),
    ],
)
def test_bad_input_fails_before_anything_is_made(
    runs_dir: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    code, out = invoke("submit", *args, "--json", env=env)
    assert code != 0 and message in out
    assert list_runs(runs_dir) == []


def test_gateway_dead_probes_env_overrides_the_preset(runs_dir: Path) -> None:
    code, out = invoke("submit", "-p", "tiny-cpu", "--dry-run", "--json", env={"GATEWAY_DEAD_PROBES": "0"})
    assert code == 0, out
    assert "dead_probes: 0" in Path(json.loads(out)["preset_file"]).read_text()


def test_unknown_run_is_a_clear_error(runs_dir: Path) -> None:
    code, out = invoke("status", "nope")
    assert code != 0 and "no run matches 'nope'" in out


def _local_job(runs_dir: Path, body: str) -> str:
    """A run whose job script is `body` (not a rendered one), submitted to the real local scheduler."""
    run = create_run("hand-made", "local", base=runs_dir)
    run.script.write_text("#!/bin/bash\nset -eu\n" + body)
    job_id = LocalScheduler().submit(run.script, run.path)
    record_submission(run, job_id)
    return run.run_id


def _wait_for(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_status_of_a_job_that_has_not_claimed_its_gateway_port_yet(runs_dir: Path) -> None:
    run_id = _local_job(runs_dir, 'touch "$MILES_RUN_DIR/started"; sleep 300\n')
    run_dir = runs_dir / run_id
    (run_dir / "preset.yaml").write_text("gateway:\n  host: 127.0.0.1\n  port: null\n")
    _wait_for(run_dir / "started")
    try:
        code, out = invoke("status", run_id, "--json")
        assert code == 0, out
        status = json.loads(out)
        assert status["state"] == "RUNNING" and status["gateway_url"] is None and status["healthz"] is None
    finally:
        invoke("cancel", run_id)


def test_status_logs_and_cancel_of_a_running_job(runs_dir: Path, healthz: str) -> None:
    body = (
        'LOGS="$MILES_RUN_DIR/logs"\n'
        f'printf "export MILES_GATEWAY_URL=%q\\n" {healthz} > "$MILES_RUN_DIR/job.env"\n'
        'echo "driver up" >> "$LOGS/driver.log"\n'
        'echo "monitor: healthy" >> "$LOGS/monitor.log"; touch "$MILES_RUN_DIR/healthy"\n'
        "sleep 300\n"
    )
    run_id = _local_job(runs_dir, body)
    run_dir = runs_dir / run_id
    _wait_for(run_dir / "healthy")
    code, out = invoke("status", run_id, "--json")
    status = json.loads(out)
    assert status["state"] == "RUNNING" and status["phase"] == "serving"
    assert status["gateway_url"] == healthz
    assert status["healthz"]["status_code"] == 200

    code, out = invoke("logs", run_id)
    assert "[driver] driver up" in out and "[monitor] monitor: healthy" in out
    code, out = invoke("logs", run_id, "--component", "driver")
    assert out.strip() == "[driver] driver up"
    code, out = invoke("logs", run_id, "--component", "nope")
    assert code != 0 and "components: driver, job, monitor" in out

    code, out = invoke("cancel", run_id, "--json")
    assert code == 0 and json.loads(out) == {
        "run_id": run_id,
        "job_id": json.loads((run_dir / "job.json").read_text())["job_id"],
        "cancelled": True,
        "state": "CANCELLED",
    }
    record = json.loads((run_dir / "job.json").read_text())
    assert record["state"] == "CANCELLED" and {"SUBMITTED", "RUNNING", "CANCELLED"} <= set(
        record["state_times"]
    )
    code, out = invoke("cancel", run_id)
    assert code == 0 and "already ended" in out


def test_logs_follow_until_the_job_ends(runs_dir: Path) -> None:
    body = 'for i in 1 2 3; do echo "step $i" >> "$MILES_RUN_DIR/logs/driver.log"; sleep 0.3; done\nexit 5\n'
    run_id = _local_job(runs_dir, body)
    code, out = invoke("logs", "-f", run_id, "--component", "driver")
    assert code == 0
    assert out.splitlines() == ["[driver] step 1", "[driver] step 2", "[driver] step 3"]
    code, out = invoke("status", run_id, "--json")
    data = json.loads(out)
    assert (data["state"], data["exit_code"], data["healthz"]) == ("FAILED", 5, None)


def test_recorded_exit_refines_a_wrapper_completed() -> None:
    done = JobState(State.COMPLETED, "C", None)
    assert _with_recorded_exit(done, 3) == JobState(State.FAILED, "C", 3)
    assert _with_recorded_exit(done, 0) == JobState(State.COMPLETED, "C", 0)
    assert _with_recorded_exit(done, None) == done
    running = JobState(State.RUNNING, "R", None)
    assert _with_recorded_exit(running, 3) == running


def test_a_job_ended_by_the_walltime_notice_reads_timeout() -> None:
    failed = JobState(State.FAILED, "FAILED", 5)
    notice = "SIGUSR1: the scheduler gave notice before the time limit"
    assert _with_end_reason(failed, notice) == JobState(State.TIMEOUT, "FAILED", 5)
    assert _with_end_reason(failed, None) == failed  # a plain exit 5 stays a failure
    assert (
        _with_end_reason(JobState(State.CANCELLED, "CANCELLED", 143), "SIGTERM: x").state is State.CANCELLED
    )
    running = JobState(State.RUNNING, "RUNNING", None)
    assert _with_end_reason(running, notice) == running
