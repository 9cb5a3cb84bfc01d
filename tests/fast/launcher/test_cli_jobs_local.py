"""The acceptance for the embedded scheduler: the tiny-cpu preset's real job script on this machine
(Ray head on 127.0.0.2, the watchdog, a stand-in driver), then `launcher cancel` stops its process group.
Marked `system`: it runs a real Ray node and subprocesses (about 15 s)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fast.launcher.pinned_ports import CLI_JOBS_LOCAL, free_block

pytestmark = [pytest.mark.system, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
LAUNCHER = str(Path(sys.executable).with_name("launcher"))
FAKE_DRIVER = REPO / "tests" / "system" / "helpers" / "fake_driver.py"


def launcher_json(*args: str, env: dict[str, str]) -> dict:
    result = subprocess.run([LAUNCHER, *args, "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, f"launcher {args} failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def group_members(pgid: int) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, NotADirectoryError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(f"{entry.name} {stat[: stat.rindex(')') + 1]}")
    return found


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != "GATEWAY_DEAD_PROBES"}
    return {**environ, "MILES_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}


def test_dry_run_prints_run_dir_and_script(env: dict[str, str]) -> None:
    data = launcher_json("submit", "--preset", "tiny-cpu", "--scheduler", "local", "--dry-run", env=env)
    assert Path(data["run_dir"]).is_dir() and Path(data["script"]).is_file()
    assert Path(data["script"]).parent == Path(data["run_dir"])
    check = subprocess.run(["bash", "-n", data["script"]], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_local_job_starts_and_cancel_stops_its_group(env: dict[str, str], tmp_path: Path) -> None:
    base = free_block(3 + 10 + 100, CLI_JOBS_LOCAL)  # gateway, GCS, client, node ports, worker ports
    overrides = [
        f"driver.command={json.dumps([sys.executable, str(FAKE_DRIVER)])}",
        f"gateway.port={base}",
        f"ray.gcs_port={base + 1}",
        f"ray.client_server_port={base + 2}",
        f"ray.node_port_base={base + 3}",
        "ray.worker_ports_per_node=100",
        f"ray.worker_port_base={base + 13}",
        f"ray.temp_dir=/tmp/mr-{os.getpid()}",
        "ray.num_cpus=1",
        "ray.object_store_memory_mb=80",
        "watchdog.startup_probe_interval_s=0.5",
    ]
    args = [a for o in overrides for a in ("--set", o)]
    sub = launcher_json("submit", "--preset", "tiny-cpu", "--scheduler", "local", *args, env=env)
    run_dir = Path(sub["run_dir"])
    pgid = int(sub["job_id"])
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "healthy").exists():
            logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
            assert time.monotonic() < deadline, f"local job never became healthy:\n{logs}"
            assert launcher_json("status", sub["run_id"], env=env)["state"] == "RUNNING", logs
            time.sleep(0.5)
        status = launcher_json("status", sub["run_id"], env=env)
        assert (status["state"], status["phase"]) == ("RUNNING", "serving")
        assert status["healthz"]["status_code"] == 200
        members = group_members(pgid)
        assert any("ray" in m or "gcs_server" in m or "raylet" in m for m in members), members

        result = launcher_json("cancel", sub["run_id"], env=env)
        assert result["cancelled"] is True and result["state"] == "CANCELLED"
        assert group_members(pgid) == []
    finally:
        # never `kill -KILL -PGID` through the kill binary: procps parses it as kill(-1), i.e. every process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
