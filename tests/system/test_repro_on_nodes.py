"""The keep-alive race reproduction sent to a node of the local Slurm cluster (submitit) and of the local
OpenPBS cluster (a generated script and qsub): the result table comes back to the submitting side.

Short on purpose: two engines, one bucket. The engines keep idle connections 3 s and a 100 ms link (one
way) opens the race window to gaps in (2.8, 3.0) s; a 2.9 s gap aims at its middle. Our client (2 s
expiry) has dropped its connections by then and must never fail; httpx's default client (5 s) reuses them
and meets the engines' close (up to 3 attempts, as in test_keepalive_repro.py: it is a timing window).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pbstools import qstat_x

pytestmark = [pytest.mark.system, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "fork" / "keepalive_race_repro.py"
SHORT_RUN = (
    "--modes", "broadcast", "--clients", "base,fixed", "--engines", "2", "--rounds", "1",
    "--engine-keepalive", "3", "--gap", "2.9", "--jitter-ms", "0", "--latency-ms", "100",
    "--time", "00:05:00", "--cpus", "2",
)  # fmt: skip
ATTEMPTS = 3
SLURM_NODES = {"node1", "node2", "node3"}
PBS_NODES = {"pbsnode1", "pbsnode2", "pbsnode3"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _submit(tmp_path: Path, mode: str) -> tuple[str, dict]:
    out = tmp_path / "report.json"
    argv = [sys.executable, str(TOOL), "--submit", mode, *SHORT_RUN, "--folder", str(tmp_path / "jobs")]
    proc = subprocess.run(
        [*argv, "--json", str(out)], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _check_race(tmp_path: Path, mode: str, nodes: set[str]) -> str:
    for _ in range(ATTEMPTS):
        stdout, report = _submit(tmp_path, mode)
        assert report["node"] in nodes and f"ran on {report['node']} ({mode})" in stdout
        assert (
            "| broadcast | base | 3 s | 2 |" in stdout and "| broadcast | fixed | 3 s | 2 | 0 | 0 |" in stdout
        )
        runs = {run["client"]: run for run in report["runs"]}
        assert runs["fixed"]["failure_idle_s"] == [] and runs["base"]["requests"] == 2
        if runs["base"]["failure_idle_s"]:
            break
    assert runs["base"]["failure_idle_s"], f"in {ATTEMPTS} runs on a node the base client never met the race"
    assert all(2.8 < idle < 3.0 for idle in runs["base"]["failure_idle_s"])
    return stdout


def test_repro_runs_on_a_slurm_node_through_submitit(slurm_cluster: None, tmp_path: Path) -> None:
    stdout = _check_race(tmp_path, "slurm", SLURM_NODES)
    job_id = stdout.split("submitted Slurm job ")[1].split(";")[0]
    # submitit kept the node's own output: the tool's table as it printed it there
    assert (
        "| broadcast | fixed | 3 s | 2 | 0 | 0 |"
        in (tmp_path / "jobs" / job_id / f"{job_id}_0_log.out").read_text()
    )


def _start_long_run(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], str]:
    """The repro submitted with a 60 s gap (it runs until stopped); returns the submitter and the job id."""
    argv = [
        sys.executable,
        "-u",
        str(TOOL),
        "--submit",
        mode,
        "--gap",
        "60",
        "--rounds",
        "3",
        "--engines",
        "1",
    ]
    proc = subprocess.Popen(
        [*argv, "--folder", str(tmp_path / "jobs")],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("submitted "):
        proc.kill()
        pytest.fail(f"no job submitted: {line}{proc.communicate(timeout=30)[1][-2000:]}")
    return proc, line.split()[3].rstrip(";")


def _wait_running(log: Path, marker: str) -> None:
    deadline = time.monotonic() + 60
    while marker not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.5)


def test_a_cancelled_slurm_job_ends_the_wait_with_its_log(slurm_cluster: None, tmp_path: Path) -> None:
    # submitit alone asks sacct, which this cluster lacks (no slurmdbd): without the scontrol watcher the
    # submitter would wait for a result that never comes
    proc, job_id = _start_long_run(tmp_path, "slurm")
    try:
        _wait_running(tmp_path / "jobs" / job_id / f"{job_id}_0_log.out", "Loading pickle")
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert f"Slurm job {job_id}" in stderr and "has not produced any output" in stderr


def test_a_stopped_submitter_cancels_its_slurm_job(slurm_cluster: None, tmp_path: Path) -> None:
    proc, job_id = _start_long_run(tmp_path, "slurm")
    try:
        _wait_running(tmp_path / "jobs" / job_id / f"{job_id}_0_log.out", "Loading pickle")
        proc.terminate()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15
    state = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    assert "JobState=CANCELLED" in state.stdout or "JobState=COMPLETING" in state.stdout, state.stdout


def test_a_stopped_submitter_deletes_its_pbs_job(pbs_cluster: None, tmp_path: Path) -> None:
    proc, job_id = _start_long_run(tmp_path, "pbs")
    try:
        (folder,) = (tmp_path / "jobs").glob("pbs-*")
        _wait_running(folder / "node.txt", "pbsnode")
        proc.terminate()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + 15
    deadline = time.monotonic() + 60
    while (attrs := qstat_x(job_id)).get("job_state") != "F" and time.monotonic() < deadline:
        time.sleep(1)
    assert attrs.get("job_state") == "F", attrs  # qdel'd: its three 60 s gaps would keep it 3 minutes


def test_repro_runs_on_a_pbs_node_through_qsub(pbs_cluster: None, tmp_path: Path) -> None:
    _check_race(tmp_path, "pbs", PBS_NODES)
    folder = sorted((tmp_path / "jobs").glob("pbs-*"))[-1]  # the last attempt's
    assert "| broadcast | fixed | 3 s | 2 | 0 | 0 |" in (folder / "job.out").read_text()
