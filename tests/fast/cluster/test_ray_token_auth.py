"""A job's Ray cluster admits only holders of the job's token (Ray's token authentication).

The job script's own token lines (rendered from templates/common/main.sh.j2) write the token; a real
`ray start --head` runs with the environment the job gives every node. A worker node and a driver without
the token are refused, a driver with a wrong token too; the job's driver (miles.cluster.ray_setup.connect)
with the token joins and runs a task. Loopback 127.0.20.x keeps clear of the Slurm (127.0.0.2-4) and PBS
(127.0.10.x) kits.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.presets import load_preset
from launcher.render import render_job_script

HEAD_IP, STRANGER_IP = "127.0.20.1", "127.0.20.2"
RAY_BIN = str(Path(sys.executable).with_name("ray"))
REFUSED = "Authentication token is missing or incorrect"
CLIENT = """
import ray, sys
ray.init(address=sys.argv[1], log_to_driver=False)
print("JOINED", ray.get(ray.remote(lambda: 41 + 1).remote()))
"""


def token_lines(script: str) -> str:
    """The job script's lines that create the token and export the auth settings."""
    start = script.index("export RAY_AUTH_MODE=token")
    end = script.index("\n", script.index("|| die", start))
    return script[start:end]


def free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


def bare_env(home: Path, **extra: str) -> dict[str, str]:
    """No Ray auth settings and a HOME without ~/.ray/auth_token: a stranger on the cluster network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **extra}


@pytest.fixture
def job_token(tmp_path: Path) -> dict[str, str]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_job_script(load_preset("tiny-cpu", env={}), "local", run_dir, sys.executable)
    shell = f'die() {{ echo "$*" >&2; exit 1; }}\nRUN_DIR={run_dir}\n{token_lines(script)}\nenv'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if line.startswith("RAY_AUTH"))
    return exported


@pytest.fixture
def ray_head(tmp_path: Path, job_token: dict[str, str]) -> Iterator[str]:
    port = free_port(HEAD_IP)
    temp_dir = tempfile.mkdtemp(prefix="mra-", dir="/tmp")  # Ray's socket paths need a short base
    env = bare_env(tmp_path, **job_token)
    argv = [RAY_BIN, "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=1"]
    argv += ["--include-dashboard=false", f"--temp-dir={temp_dir}", "--disable-usage-stats", "--block"]
    log = (tmp_path / "head.log").open("w")
    head = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (tmp_path / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        yield f"{HEAD_IP}:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block drains its own GCS and raylet
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_the_job_token_is_private_and_random(job_token: dict[str, str]) -> None:
    assert job_token["RAY_AUTH_MODE"] == "token"
    path = Path(job_token["RAY_AUTH_TOKEN_PATH"])
    assert path.stat().st_mode & 0o777 == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", path.read_text())


@pytest.mark.slow
def test_only_holders_of_the_job_token_join_or_submit(
    tmp_path: Path, job_token: dict[str, str], ray_head: str
) -> None:
    stranger = bare_env(tmp_path)
    worker_temp = tempfile.mkdtemp(prefix="mrw-", dir="/tmp")
    argv = [RAY_BIN, "start", f"--address={ray_head}", f"--node-ip-address={STRANGER_IP}", "--num-cpus=1"]
    argv += [f"--temp-dir={worker_temp}", "--disable-usage-stats", "--block"]
    try:
        worker = subprocess.run(
            argv,
            env=stranger,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(worker_temp, ignore_errors=True)
    assert worker.returncode != 0 and REFUSED in worker.stdout + worker.stderr

    wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for env in (stranger, bare_env(tmp_path, **wrong)):
        try:
            client = subprocess.run(
                [sys.executable, "-c", CLIENT, ray_head], env=env, capture_output=True, text=True, timeout=25
            )
            out, err = client.stdout, client.stderr
        except subprocess.TimeoutExpired as slow:  # ray.init retries a refusing GCS before giving up
            out, err = (slow.stdout or b"").decode(), (slow.stderr or b"").decode()
        assert "JOINED" not in out
        assert REFUSED in err

    # the job's driver, with the environment the job script exports, joins and runs work
    driver = "from miles.cluster.ray_setup import connect; connect(timeout_s=60)\n" + CLIENT.replace(
        "ray.init(address=sys.argv[1], log_to_driver=False)", ""
    )
    joined = subprocess.run(
        [sys.executable, "-c", driver, ray_head],
        env=bare_env(tmp_path, RAY_ADDRESS=ray_head, **job_token),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "JOINED 42" in joined.stdout, joined.stderr[-2000:]


def test_a_driver_whose_token_cannot_be_read_says_so_before_connecting(tmp_path: Path, monkeypatch) -> None:
    from miles.cluster.ray_setup import RayConnectError, auth_token_problem, connect

    token = tmp_path / "ray-auth-token"
    assert auth_token_problem({"RAY_AUTH_MODE": "disabled"}) is None
    assert "neither RAY_AUTH_TOKEN nor" in (auth_token_problem({"RAY_AUTH_MODE": "token"}) or "")
    missing = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    assert f"{token} (RAY_AUTH_TOKEN_PATH) cannot be read" in (auth_token_problem(missing) or "")
    token.write_text("\n")
    assert "is empty" in (auth_token_problem(missing) or "")
    token.write_text(secrets.token_hex(32))
    assert auth_token_problem(missing) is None
    token.unlink()
    for name, value in missing.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RayConnectError, match=r"at 127\.0\.20\.9:1: the job.s Ray token"):
        connect("127.0.20.9:1", timeout_s=1)
