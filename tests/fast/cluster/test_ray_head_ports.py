"""What a job's Ray head opens, and to whom: the rendered ray-node.sh run as the head with real Ray.

Every listening socket of the head's process tree is either bound to the node's own address or loopback,
or is one of Ray's gRPC servers, which check the job's token (GCS, raylet, object manager, the dashboard
agent's gRPC port, core workers: Ray binds those to every interface and has no option to narrow them).
Ray's Prometheus endpoints, which answer anyone without a token on every interface, are off: the node's
metrics export port, the autoscaler monitor's (44217) and the dashboard process's (44227). The HTTP
servers on the node's address refuse a request without the token (the dashboard agent's job route runs
commands, so it matters). Loopback 127.0.20.x: clear of the Slurm and PBS kits (test_ray_token_auth).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.presets import load_preset
from launcher.render import render_job_script
from tests.fast.cluster.test_ray_token_auth import bare_env, free_port, job_token  # noqa: F401
from tests.fast.launcher.test_render import ray_node_script

HEAD_IP = "127.0.20.3"
RAY_BIN = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parents[3]
WILDCARD = ("0.0.0.0", "::", "::ffff:0.0.0.0")
PROMETHEUS_PORTS = {44217: "autoscaler monitor metrics", 44227: "dashboard metrics", 8265: "dashboard"}


def write_job_env(run_dir: Path, temp_base: str, token_env: dict[str, str]) -> None:
    """The job.env the job script writes (the names write_job_env exports), for one node of this job."""
    values = {
        "PATH": os.environ["PATH"],
        "RUN_DIR": run_dir,
        "PY": sys.executable,
        "RAY_BIN": RAY_BIN,
        "JOB_KEY": "h1",
        "JOB_LABEL": "miles_job_ports_test",
        "GPUS_PER_NODE": 0,
        "RAY_GCS_PORT": free_port(HEAD_IP),
        "RAY_CLIENT_PORT": free_port(HEAD_IP),
        "RAY_NODE_PORT_BASE": "",  # claimed free, as in a job without a fixed plan
        "RAY_WORKER_PORT_BASE": "",
        "RAY_WORKER_PORT_SPAN": 50,
        "RAY_TEMP_BASE": temp_base,
        "RAY_NUM_CPUS": 1,
        "RAY_OBJECT_STORE_BYTES": "",
        "RAY_USAGE_STATS_ENABLED": 0,
        **token_env,
    }
    (run_dir / "job.env").write_text("".join(f"export {k}='{v}'\n" for k, v in values.items()))


@pytest.fixture
def job_head(tmp_path: Path, job_token: dict[str, str]) -> Iterator[tuple[psutil.Process, dict[str, int]]]:  # noqa: F811
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    script = render_job_script(load_preset("tiny-cpu", env={}), "local", run_dir, sys.executable)
    node_script = run_dir / "ray-node.sh"
    node_script.write_text(ray_node_script(script))
    node_script.chmod(0o755)
    temp_base = tempfile.mkdtemp(prefix="mrp-", dir="/tmp")  # Ray's socket paths need a short base
    write_job_env(run_dir, temp_base, job_token)
    env = bare_env(tmp_path, PYTHONPATH=str(REPO), MILES_PORT_CLAIMS_DIR=str(tmp_path / "claims"))
    head = subprocess.Popen([str(node_script), "head", "0", HEAD_IP], env=env, start_new_session=True)
    log = run_dir / "logs" / "ray-head.log"
    try:
        deadline = time.monotonic() + 90
        while not log.exists() or "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, (
                log.read_text() if log.exists() else ""
            )
            time.sleep(0.5)
        env_lines = (run_dir / "ports" / "node-0.env").read_text().split()
        ports = {k: int(v) for k, v in (line.split("=", 1) for line in env_lines)}
        for line in (run_dir / "job.env").read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            if name in ("RAY_GCS_PORT", "RAY_CLIENT_PORT"):
                ports[name] = int(value.strip("'"))
        yield psutil.Process(head.pid), ports
    finally:
        head.send_signal(signal.SIGTERM)  # --block drains its own GCS and raylet
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp_base, ignore_errors=True)


def listeners(root: psutil.Process) -> list[tuple[str, int, str]]:
    """(address, port, process title) of every TCP socket the tree under `root` listens on."""
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            title = " ".join(proc.cmdline())[:80] or proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((conn.laddr.ip, conn.laddr.port, title))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def is_core_worker(title: str) -> bool:
    """A Ray worker process (its title is ray::IDLE, or ray::<task>), not one of the agents."""
    return title.startswith("ray::") and not title.startswith(("ray::DashboardAgent", "ray::RuntimeEnv"))


def status_without_token(url: str, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


@pytest.mark.slow
def test_the_job_head_opens_only_token_checked_grpc_to_the_network(
    job_head: tuple[psutil.Process, dict[str, int]],
) -> None:
    root, ports = job_head
    grpc = {ports[name] for name in ("RAY_GCS_PORT", "NODE_MANAGER_PORT", "OBJECT_MANAGER_PORT")}
    grpc.add(ports["AGENT_GRPC_PORT"])
    deadline = time.monotonic() + 20  # the agents come up a moment after "Ray runtime started"
    while ports["AGENT_LISTEN_PORT"] not in {port for _, port, _ in listeners(root)}:
        assert time.monotonic() < deadline, listeners(root)
        time.sleep(0.5)
    time.sleep(2)  # the dashboard process sets up its metrics server after it connects to the GCS
    found = listeners(root)

    open_to_all = [
        (ip, port, title)
        for ip, port, title in found
        if ip in WILDCARD and port not in grpc and not is_core_worker(title)
    ]
    assert open_to_all == [], f"listening on every interface, outside Ray's token-checked gRPC: {open_to_all}"
    bound = {port for _, port, _ in found}
    assert ports["METRICS_PORT"] not in bound, "the metrics export port is on"
    assert not bound & PROMETHEUS_PORTS.keys(), [PROMETHEUS_PORTS[p] for p in bound & PROMETHEUS_PORTS.keys()]
    assert grpc <= bound  # the check above saw Ray's servers

    # the HTTP servers on the node's address: bound there (or loopback) and refusing a tokenless request
    for name in ("AGENT_LISTEN_PORT", "RUNTIME_ENV_AGENT_PORT", "RAY_CLIENT_PORT"):
        addresses = {ip.removeprefix("::ffff:") for ip, port, _ in found if port == ports[name]}
        assert addresses and addresses <= {HEAD_IP, "127.0.0.1"}, (name, addresses)
    submit = b'{"entrypoint": "true", "submission_id": "stranger"}'
    agent = f"http://{HEAD_IP}:{ports['AGENT_LISTEN_PORT']}"
    assert status_without_token(f"{agent}/api/job_agent/jobs/", submit) == 401
    assert (
        status_without_token(f"http://{HEAD_IP}:{ports['RUNTIME_ENV_AGENT_PORT']}/get_or_create_runtime_env")
        == 401
    )
