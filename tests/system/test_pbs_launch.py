"""The PBS job script under the local cluster's PBS environment: qsub (Torque wrappers over Slurm),
PBS_NODEFILE / PBS_JOBID, workers started through a pbsdsh stand-in that forwards to srun."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from jobtools import HELPERS, launcher, launcher_json, run_logs, system_preset, wait_until

PBS_OPTIONS = {"pbs": {"project": "testgrp", "queue": "rt_HF", "walltime": "00:05:00", "launch": "pbsdsh"}}


def scontrol_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    return dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)


def test_project_directive_breaks_the_wrappers_without_the_option(
    slurm_cluster, runs_dir, write_preset
) -> None:
    preset = write_preset(system_preset("sys-pbs-p", nodes=1, train_nodes=1, scheduler_extra=PBS_OPTIONS))
    result = launcher("submit", "--preset", str(preset), "--scheduler", "pbs", "--json")
    assert result.returncode != 0
    assert "invalid option -- 'P'" in result.stderr + result.stdout  # qsub's own words, kept


def test_pbs_script_on_three_nodes_via_qsub(slurm_cluster, runs_dir, write_preset, slurm_jobs) -> None:
    preset = write_preset(system_preset("sys-pbs", nodes=3, train_nodes=1, scheduler_extra=PBS_OPTIONS))
    env = {"PATH": f"{HELPERS / 'bin'}{os.pathsep}{os.environ['PATH']}"}  # the pbsdsh stand-in
    sub = launcher_json(
        "submit", "--preset", str(preset), "--scheduler", "pbs", "--pbs-project-on-command-line", env=env
    )
    slurm_jobs.append(sub["job_id"].split(".")[0])
    run_dir = Path(sub["run_dir"])
    script = Path(sub["script"]).read_text()
    assert "#PBS -P" not in script and "#PBS -l select=3" in script and "#PBS -q rt_HF" in script
    wait_until(lambda: (run_dir / "healthy").exists(), 120, f"the watchdog to see 200\n{run_logs(run_dir)}")

    job_log = (run_dir / "logs" / "job.log").read_text()
    assert "ray: 3 nodes alive" in job_log and f"job {sub['job_id']} (pbs)" in job_log
    assert scontrol_fields(sub["job_id"])["NumNodes"] == "3"
    rows = [line.split("\t") for line in (run_dir / "roles.tsv").read_text().splitlines()[1:]]
    assert "head" in rows[-1][-1] and len(rows) == 3
    status = launcher_json("status", sub["run_id"])
    assert (status["state"], status["scheduler_state"], status["phase"]) == ("RUNNING", "R", "serving")

    (run_dir / "driver-dead").touch()
    final = wait_until(
        lambda: (s := launcher_json("status", sub["run_id"]))["state"] not in ("RUNNING", "PENDING") and s,
        60,
        "the watchdog to end the PBS job",
    )
    assert final["scheduler_state"] == "C"
    fields = scontrol_fields(sub["job_id"])
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "3:0"), run_logs(run_dir)
    assert "trainer dead while serving" in (run_dir / "logs" / "monitor.log").read_text()


def test_cancel_a_pbs_job_with_qdel(slurm_cluster, runs_dir, write_preset, slurm_jobs) -> None:
    preset = write_preset(
        system_preset("sys-pbs-cancel", nodes=1, train_nodes=1, scheduler_extra=PBS_OPTIONS)
    )
    sub = launcher_json(
        "submit", "--preset", str(preset), "--scheduler", "pbs", "--pbs-project-on-command-line"
    )
    slurm_jobs.append(sub["job_id"].split(".")[0])
    wait_until(lambda: launcher_json("status", sub["run_id"])["state"] == "RUNNING", 60, "the PBS job to run")
    assert launcher_json("cancel", sub["run_id"])["cancelled"] is True
    wait_until(
        lambda: scontrol_fields(sub["job_id"])["JobState"] == "CANCELLED", 60, "qdel to cancel the job"
    )
    assert launcher_json("status", sub["run_id"])["state"] != "RUNNING"
