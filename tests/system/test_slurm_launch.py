"""`launcher submit --scheduler slurm` on the real 3-node local Slurm cluster, the watchdog ending the job."""

from __future__ import annotations

import subprocess
from pathlib import Path

from jobtools import launcher, launcher_json, run_logs, system_preset, wait_until


def scontrol_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    )
    return dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)


def test_three_node_job_ends_on_dead_probes(slurm_cluster, runs_dir, write_preset, slurm_jobs) -> None:
    preset = write_preset(system_preset("sys-slurm", nodes=3, train_nodes=1))
    sub = launcher_json("submit", "--preset", str(preset), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    wait_until(lambda: (run_dir / "healthy").exists(), 120, f"the watchdog to see 200\n{run_logs(run_dir)}")

    fields = scontrol_fields(sub["job_id"])
    assert fields["NumNodes"] == "3" and fields["JobState"] == "RUNNING"
    job_log = (run_dir / "logs" / "job.log").read_text()
    assert "ray: 3 nodes alive" in job_log
    rows = [line.split("\t") for line in (run_dir / "roles.tsv").read_text().splitlines()[1:]]
    assert len(rows) == 3 and "head" in rows[-1][-1] and all("head" not in r[-1] for r in rows[:-1])
    assert "node roles: head" in job_log

    status = launcher_json("status", sub["run_id"])
    assert (status["state"], status["phase"], status["job_id"]) == ("RUNNING", "serving", sub["job_id"])
    assert status["healthz"]["status_code"] == 200
    assert status["gateway_url"].startswith("http://127.0.0.")

    (run_dir / "driver-dead").touch()
    final = wait_until(
        lambda: (s := launcher_json("status", sub["run_id"]))["state"] not in ("RUNNING", "PENDING") and s,
        60,
        "the watchdog to end the job",
    )
    assert (final["state"], final["exit_code"]) == ("FAILED", 3), run_logs(run_dir)
    fields = scontrol_fields(sub["job_id"])
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "3:0")
    monitor_log = (run_dir / "logs" / "monitor.log").read_text()
    assert "trainer dead while serving: 2 consecutive 503s" in monitor_log
    assert "no trainer cell alive" in monitor_log

    logs = launcher("logs", sub["run_id"])
    assert logs.returncode == 0
    assert "[monitor]" in logs.stdout and "[driver] fake driver: serving healthz" in logs.stdout
    assert "[ray-worker-" in logs.stdout and "[job]" in logs.stdout


def test_cancel_a_running_slurm_job(slurm_cluster, runs_dir, write_preset, slurm_jobs) -> None:
    preset = write_preset(system_preset("sys-cancel", nodes=1, train_nodes=1))
    sub = launcher_json("submit", "--preset", str(preset), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    wait_until(lambda: launcher_json("status", sub["run_id"])["state"] == "RUNNING", 60, "the job to run")
    cancelled = launcher_json("cancel", sub["run_id"])
    assert cancelled["cancelled"] is True
    wait_until(
        lambda: scontrol_fields(sub["job_id"])["JobState"] == "CANCELLED", 60, "Slurm to cancel the job"
    )
    assert launcher_json("status", sub["run_id"])["state"] == "CANCELLED"


def test_the_walltime_notice_ends_the_job_in_order(slurm_cluster, runs_dir, write_preset, slurm_jobs) -> None:
    """USR1 to the batch shell, what `--signal=B:USR1@120` sends before the time limit (here by
    `scancel --batch --signal=USR1`): the job shuts down in order, with the walltime exit code and the
    reason recorded."""
    preset = system_preset("sys-notice", nodes=1, train_nodes=1)
    sub = launcher_json("submit", "--preset", str(write_preset(preset)), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    script = Path(sub["script"]).read_text()
    assert "\n#SBATCH --signal=B:USR1@120\n#SBATCH --no-requeue\n" in script
    wait_until(lambda: (run_dir / "healthy").exists(), 120, f"healthz 200\n{run_logs(run_dir)}")

    subprocess.run(["scancel", "--batch", "--signal=USR1", sub["job_id"]], check=True, timeout=30)
    final = wait_until(
        lambda: (s := launcher_json("status", sub["run_id"]))["state"] not in ("RUNNING", "PENDING") and s,
        60,
        "the job to end on the walltime notice",
    )
    assert (final["state"], final["exit_code"]) == ("TIMEOUT", 5), run_logs(run_dir)
    assert final["end_reason"].startswith("SIGUSR1: ")
    job_log = (run_dir / "logs" / "job.log").read_text()
    assert "caught SIGUSR1 (the scheduler gave notice before the time limit)" in job_log
    assert "job done, exit status 5" in job_log
    assert scontrol_fields(sub["job_id"])["ExitCode"] == "5:0"
