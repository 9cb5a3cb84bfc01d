"""`launcher submit --wait` on the real local Slurm cluster: it returns 0 once the job serves and prints
how to reach it; a job whose driver fails makes it return the driver's status with the driver log's tail.
The launcher runs without a terminal here, so this is the plain one-line-per-transition mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jobtools import launcher, launcher_json, run_logs, system_preset

WAIT_S = "150"


def test_submit_wait_returns_once_serving_and_prints_the_url(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str]
) -> None:
    preset = write_preset(system_preset("sys-wait", nodes=1, train_nodes=1))
    out = launcher(
        "submit", "--preset", str(preset), "--scheduler", "slurm", "--wait", "--timeout", WAIT_S, timeout=240
    )
    run_id = out.stdout.split(":", 1)[0].strip()
    status = launcher_json("status", run_id)
    slurm_jobs.append(status["job_id"])
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{run_logs(Path(status['run_dir']))}"
    assert f"submitted slurm job {status['job_id']}" in out.stdout
    transitions = [line.split()[1] for line in out.stdout.splitlines() if line[:8].strip().endswith("s")]
    assert transitions[-1] == "serving" and transitions[0] in ("PENDING", "RUNNING"), out.stdout
    url = status["gateway_url"]
    port = url.rsplit(":", 1)[1]
    head = url.split("//", 1)[1].rsplit(":", 1)[0]
    assert f"gateway:      {url}" in out.stdout
    assert "API key file: (none in the run directory" in out.stdout  # the stand-in driver makes no key
    assert f"  export TINKER_BASE_URL={url}\n" in out.stdout
    assert f"ssh -N -L {port}:{head}:{port} " in out.stdout
    assert status["state"] == "RUNNING" and status["healthz"]["status_code"] == 200  # it serves right now

    again = launcher_json("wait", run_id)  # a serving job: the wait ends at once, same answer as JSON
    assert again["outcome"] == "serving" and again["connect"]["gateway_url"] == url
    assert launcher_json("cancel", run_id)["cancelled"] is True


def test_submit_wait_on_a_failing_driver_returns_its_status_and_log_tail(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str]
) -> None:
    preset = system_preset("sys-wait-fail", nodes=1, train_nodes=1)
    refuse = "print('driver: model.path /nowhere is not a directory; refusing to start'); raise SystemExit(2)"
    preset["driver"] = {"command": [sys.executable, "-c", refuse]}
    args = ("submit", "--preset", str(write_preset(preset)), "--scheduler", "slurm", "--wait")
    out = launcher(*args, "--json", timeout=240)
    data = json.loads(out.stdout)
    slurm_jobs.append(data["job_id"])
    assert out.returncode == 2, f"{out.stdout}\n{out.stderr}\n{run_logs(Path(data['run_dir']))}"
    waited = data["wait"]
    assert (waited["outcome"], waited["job_exit_code"], waited["failing_component"]) == (
        "failed",
        2,
        "driver",
    )
    assert waited["log_tail"] == ["driver: model.path /nowhere is not a directory; refusing to start"]
    assert "serving" not in [step["name"] for step in waited["steps"]]
    assert "RUNNING" in out.stderr  # the transitions went to stderr, the JSON object alone to stdout

    again = launcher("wait", data["run_id"])  # the text mode of the same failure
    assert again.returncode == 2
    assert "failed after" in again.stdout and "job exit code 2" in again.stdout
    assert "  driver: model.path /nowhere is not a directory; refusing to start" in again.stdout
