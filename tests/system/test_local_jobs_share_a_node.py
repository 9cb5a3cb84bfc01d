"""Two tiny-cpu jobs on the local scheduler at once: each claims its own ports and forms its own Ray
cluster. A job made to reuse the other's GCS port stops before `ray start`, naming the port and the preset
key that pins it (before the port claim checked pinned ports, readiness caught it: the job's Ray label kept
it from counting the other job's node as its own, which once hung it in phase `ray` until the timeout)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobtools import HELPERS, launcher, launcher_json, run_logs, wait_until

pytestmark = pytest.mark.slow

FAKE_DRIVER = f"driver.command=[{sys.executable}, {HELPERS / 'fake_driver.py'}]"


def submit_tiny(*overrides: str) -> dict:
    sets = [
        arg
        for item in (FAKE_DRIVER, "watchdog.startup_probe_interval_s=0.5", *overrides)
        for arg in ("--set", item)
    ]
    return launcher_json("submit", "--preset", "tiny-cpu", "--scheduler", "local", *sets)


def test_two_tiny_cpu_jobs_at_once_and_a_port_thief_that_fails_fast(runs_dir: Path) -> None:
    first, second = submit_tiny(), submit_tiny()
    try:
        for sub in (first, second):
            run_dir = Path(sub["run_dir"])
            healthy = run_dir / "healthy"
            wait_until(healthy.exists, 120, f"healthz 200\n{run_logs(run_dir)}")
            assert "ray: 1 nodes alive" in (run_dir / "logs" / "job.log").read_text()
        statuses = [launcher_json("status", sub["run_id"]) for sub in (first, second)]
        assert all(s["state"] == "RUNNING" and s["healthz"]["status_code"] == 200 for s in statuses)
        ports = [set(s["ports"]["head"].values()) | set(s["ports"]["node-0"].values()) for s in statuses]
        assert len(ports[0]) == len(ports[1]) == 11 and not ports[0] & ports[1], statuses
        assert statuses[0]["gateway_url"] != statuses[1]["gateway_url"]

        taken = statuses[0]["ports"]["head"]["RAY_GCS_PORT"]
        thief = submit_tiny(f"ray.gcs_port={taken}", "ray.start_timeout_s=60")
        final = wait_until(
            lambda: (
                (s := launcher_json("status", thief["run_id"]))["state"] not in ("RUNNING", "PENDING") and s
            ),
            90,
            "the job on a taken GCS port to fail",
        )
        job_log = (Path(thief["run_dir"]) / "logs" / "job.log").read_text()
        # stopped before `ray start`, by the port claim: the first job holds that port
        refused = f"RAY_GCS_PORT {taken} (ray.gcs_port: another job on this node claimed it)"
        assert final["state"] == "FAILED" and refused in job_log, job_log
        assert "nodes alive" not in job_log and "ray: head" not in job_log
        assert launcher_json("status", first["run_id"])["healthz"]["status_code"] == 200  # untouched
    finally:
        for sub in (first, second):
            launcher("cancel", sub["run_id"])
