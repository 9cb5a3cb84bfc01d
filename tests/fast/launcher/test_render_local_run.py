"""The rendered local job script, run for real: Ray head, driver, watchdog, services, teardown.

The driver is a small HTTP server that answers healthz 200 until the services command (started once the
watchdog wrote `healthy`) asks it to answer 503; two 503 probes end the job with the watchdog's status 3.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.presets import load_preset
from launcher.render import render_job_script
from miles.contract.roles import read_roles_tsv
from tests.fast.launcher.pinned_ports import RENDER_LOCAL_RUN, free_block

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


def pinned_port_plan() -> dict[str, int]:
    """The job's pinned ports as one free block: the gateway, the GCS, the Ray client server, 10 node
    ports and 64 worker ports."""
    base = free_block(3 + 10 + 64, RENDER_LOCAL_RUN)
    return {"gateway": base, "gcs": base + 1, "client": base + 2, "node": base + 3, "worker": base + 13}


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
    ports = pinned_port_plan()
    gateway_port = ports["gateway"]
    die_url = f"http://127.0.0.1:{gateway_port}/die"
    overrides = [
        f"gateway.port={gateway_port}",
        f"driver.command=[{sys.executable}, {driver}, '{gateway_port}']",
        f"services.command=[{sys.executable}, -c, 'import urllib.request as u; u.urlopen(\"{die_url}\")']",
        "watchdog.dead_probes=2",
        "watchdog.probe_interval_s=0.3",
        "watchdog.startup_probe_interval_s=0.3",
        "watchdog.startup_timeout_s=120",
        f"ray.gcs_port={ports['gcs']}",
        f"ray.client_server_port={ports['client']}",
        f"ray.node_port_base={ports['node']}",
        f"ray.worker_port_base={ports['worker']}",
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


DIE_FROM_ENV = 'import os, urllib.request as u; u.urlopen(os.environ["MILES_GATEWAY_URL"] + "/die")'


def run_in_own_group(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run a job script as its own process group; on a timeout, stop the whole group (Ray included)."""
    proc = subprocess.Popen(
        argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def test_rerun_sets_the_previous_attempt_aside_and_claims_its_own_ports(
    tmp_path: Path, short_temp: str
) -> None:
    """A requeued job finds the last attempt's files: they move to attempts/, and nothing trusts them.
    No port is fixed in the preset: the head and the node claim theirs and write them to ports/."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.replace("int(sys.argv[1])", 'int(os.environ["MILES_GATEWAY_PORT"])'))
    overrides = [
        f"driver.command=[{sys.executable}, {driver}]",
        f"services.command=[{sys.executable}, -c, '{DIE_FROM_ENV}']",
        "watchdog.dead_probes=1",
        "watchdog.probe_interval_s=0.3",
        "watchdog.startup_probe_interval_s=0.3",
        "watchdog.startup_timeout_s=120",
        "ray.worker_ports_per_node=32",
        f"ray.temp_dir={short_temp}",
        "ray.num_cpus=1",
        "ray.start_timeout_s=120",
    ]
    preset = load_preset("tiny-cpu", overrides, env={})
    assert preset.gateway.port is None and preset.ray.gcs_port is None and preset.ray.node_port_base is None
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"healthy": "", "phase": "serving\n", "exit_code": "0\n", "cells.json": '{"trainer": []}\n'}
    for name, text in stale.items():
        (run_dir / name).write_text(text)
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(preset, "local", run_dir, sys.executable))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MILES_JOB_ID": "t2",
        "MILES_PORT_CLAIMS_DIR": short_temp + "-c",
    }
    done = run_in_own_group(["bash", str(script)], env, timeout_s=240)

    job_log = (run_dir / "logs" / "job.log").read_text()
    assert done.returncode == 3, job_log
    (aside,) = (run_dir / "attempts").iterdir()
    assert {p.name for p in aside.iterdir()} == set(stale)  # every stale file went, and only those
    assert (aside / "phase").read_text() == "serving\n"
    assert "a previous attempt's run files moved to" in job_log
    assert not (run_dir / "cells.json").exists() and (run_dir / "exit_code").read_text().strip() == str(
        done.returncode
    )
    head = dict(line.split("=") for line in (run_dir / "ports" / "head.env").read_text().split())
    node = dict(line.split("=") for line in (run_dir / "ports" / "node-0.env").read_text().split())
    singles = [int(v) for k, v in (head | node).items() if not k.startswith("WORKER_PORT")]
    workers = range(int(node["WORKER_PORT_MIN"]), int(node["WORKER_PORT_MAX"]) + 1)
    assert len(set(singles)) == 9 and len(workers) == 32 and not set(singles) & set(workers)
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert f"RAY_ADDRESS=127.0.0.2:{head['RAY_GCS_PORT']}" in driver_log
    assert f"MILES_GATEWAY_URL=http://127.0.0.1:{head['GATEWAY_PORT']}" in driver_log
    assert ray_processes_using(short_temp) == []


def test_a_pinned_node_port_in_use_fails_the_job_with_the_reason_in_its_log(
    tmp_path: Path, short_temp: str
) -> None:
    """The node stops before `ray start` (miles.job.ports), the readiness wait sees its script exit, and the
    job log, which `launcher wait` tails, carries the node's own error: the port and the key to change."""
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        overrides = [
            f"driver.command=[{sys.executable}, -c, pass]",  # never reached: Ray does not form
            f"ray.node_port_base={port}",
            f"ray.temp_dir={short_temp}",
            "ray.start_timeout_s=120",
        ]
        preset = load_preset("tiny-cpu", overrides, env={})
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        script = tmp_path / "job.sh"
        script.write_text(render_job_script(preset, "local", run_dir, sys.executable))
        env = {**os.environ, "MILES_JOB_ID": "t3", "MILES_PORT_CLAIMS_DIR": short_temp + "-c"}
        done = run_in_own_group(["bash", str(script)], env, timeout_s=150)

    job_log = (run_dir / "logs" / "job.log").read_text()
    assert done.returncode != 0, job_log
    assert "exited while waiting for the Ray head" in job_log, job_log
    reason = f"NODE_MANAGER_PORT {port} (ray.node_port_base: something on this node listens on it)"
    assert (
        f"ray-head.log:Error: ports the preset pins are in use on {socket.gethostname()}: {reason}" in job_log
    )
    assert ray_processes_using(short_temp) == []
