"""The rendered local job script, run for real: Ray head, driver, watchdog, services, teardown.

The driver is a small HTTP server that answers healthz 200 until the services command (started once the
watchdog wrote `healthy`) asks it to answer 503; two 503 probes end the job with the watchdog's status 3.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.presets import load_preset
from launcher.render import render_job_script
from launcher.roles import read_roles_tsv

pytestmark = pytest.mark.slow

DRIVER = """
import http.server, os, sys
state = {"code": 200}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/die":
            state["code"] = 503
        self.send_response(200 if self.path == "/die" else state["code"])
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
for key in ("RAY_ADDRESS", "MILES_HEAD_IP", "MILES_GATEWAY_URL", "MILES_ROLES_FILE", "MILES_RUN_DIR"):
    print(f"{key}={os.environ[key]}", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def free_port_block(size: int, start: int) -> int:
    """A base port such that base..base+size-1 are all free on 127.0.0.2 right now."""
    for base in range(start, 60000, size + 7):
        sockets = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.2", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port block")


@pytest.fixture
def short_temp() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # Ray's socket paths need a short base
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_processes_using(temp_dir: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if temp_dir in line and "ps -eo" not in line]


def test_local_job_runs_ray_driver_watchdog_services_and_tears_down(tmp_path: Path, short_temp: str) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    gateway_port = free_port_block(1, 41000 + os.getpid() % 5000)
    die_url = f"http://127.0.0.1:{gateway_port}/die"
    overrides = [
        f"gateway.port={gateway_port}",
        f"driver.command=[{sys.executable}, {driver}, '{gateway_port}']",
        f"services.command=[{sys.executable}, -c, 'import urllib.request as u; u.urlopen(\"{die_url}\")']",
        "watchdog.dead_probes=2",
        "watchdog.probe_interval_s=0.3",
        "watchdog.startup_probe_interval_s=0.3",
        "watchdog.startup_timeout_s=120",
        f"ray.gcs_port={free_port_block(1, 30000 + os.getpid() % 3000)}",
        f"ray.client_server_port={free_port_block(1, 33000 + os.getpid() % 3000)}",
        f"ray.node_port_base={free_port_block(10, 36000 + os.getpid() % 3000)}",
        f"ray.worker_port_base={free_port_block(64, 50000 + os.getpid() % 5000)}",
        "ray.worker_ports_per_node=64",
        f"ray.temp_dir={short_temp}",
        "ray.num_cpus=1",
        "ray.start_timeout_s=120",
    ]
    preset = load_preset("tiny-cpu", overrides, env={})
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(preset, "local", run_dir, sys.executable))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_JOB_ID": "t1"}
    done = subprocess.run(["bash", str(script)], env=env, timeout=240, capture_output=True, text=True)

    job_log = (run_dir / "logs" / "job.log").read_text()
    assert done.returncode == 3, job_log  # the watchdog declared the trainer dead
    assert "node roles: head " in job_log and "ray: 1 nodes alive" in job_log
    assert "watchdog: the trainer is dead (2 consecutive 503s)" in job_log
    plan = read_roles_tsv(run_dir / "roles.tsv")
    assert [p.roles for p in plan.ordered] == [("trainer", "engine", "head")]
    assert plan.head.ip == "127.0.0.2"  # loopback-index test mode
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert f"RAY_ADDRESS=127.0.0.2:{preset.ray.gcs_port}" in driver_log
    assert f"MILES_GATEWAY_URL=http://127.0.0.1:{gateway_port}" in driver_log
    assert f"MILES_ROLES_FILE={run_dir}/roles.tsv" in driver_log
    assert (run_dir / "healthy").exists()
    assert "starting services" in (run_dir / "logs" / "services.log").read_text()
    assert "ray-node: head index 0 ip 127.0.0.2" in (run_dir / "logs" / "ray-head.log").read_text()
    assert "SIGKILL" not in job_log  # ray start stopped its own processes on SIGTERM
    assert ray_processes_using(short_temp) == []
