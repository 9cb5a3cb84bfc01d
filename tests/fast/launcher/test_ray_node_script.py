"""The rendered ray-node.sh run as a worker against a scripted `ray` binary: a start that exits before its
node joined (Ray's fixed 30 s registration wait ran out) is retried, a node that joined and later died is
not, a port the preset pins that is in use stops the node before `ray start`, and a signal reaches the
running `ray start`. Last, the head's readiness wait (miles.job.nodes) gives up while `ray health-check`
blocks.

Real Ray cannot be made to miss its registration window on demand, so `ray` here is a script whose
attempts follow a plan; the same script runs real Ray in the system tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.presets import load_preset
from launcher.render import render_job_script
from tests.fast.launcher.test_render import ray_node_script

REPO = Path(__file__).resolve().parents[3]

# Attempt N (counted in $STATE/count) acts out word N of $PLAN: `fail` exits 1 before joining, `join`
# prints Ray's success line and blocks until SIGTERM, `die` joins and then exits 1.
FAKE_RAY = r"""#!/bin/bash
n=$(($(cat "$STATE/count" 2>/dev/null || echo 0) + 1))
echo "$n" >"$STATE/count"
read -r -a plan <<<"$PLAN"
case "${plan[n - 1]}" in
  fail) echo "Exception: The current node timed out during startup."; exit 1 ;;
  die) echo "Ray runtime started."; exit 1 ;;
  join)
    trap 'echo stopped >"$STATE/stopped"; exit 0' TERM
    echo "Ray runtime started."
    while :; do sleep 0.1; done ;;
esac
"""


def _start_worker(tmp_path: Path, plan: str, **pinned: int) -> tuple[subprocess.Popen, Path]:
    """ray-node.sh as worker 1 with the fake `ray`; its ports are claimed free unless `pinned` (the job
    env's RAY_NODE_PORT_BASE / RAY_WORKER_PORT_BASE) fixes them."""
    script = render_job_script(load_preset("tiny-cpu", env={}), "local", tmp_path / "run", "/usr/bin/python3")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    state = tmp_path / "state"
    state.mkdir()
    ray_bin = tmp_path / "ray"
    ray_bin.write_text(FAKE_RAY)
    ray_bin.chmod(0o755)
    env_lines = {
        "RUN_DIR": run_dir,
        "RAY_BIN": ray_bin,
        "PY": sys.executable,
        "GPUS_PER_NODE": 0,
        "JOB_LABEL": "label",
        "JOB_KEY": "7",
        "RAY_ADDRESS": "127.0.0.1:1",
        "RAY_TEMP_BASE": tmp_path,
        "RAY_NUM_CPUS": 1,
        "RAY_NODE_PORT_BASE": pinned.get("RAY_NODE_PORT_BASE", ""),
        "RAY_WORKER_PORT_BASE": pinned.get("RAY_WORKER_PORT_BASE", ""),
        "RAY_WORKER_PORT_SPAN": 10,
        "RAY_OBJECT_STORE_BYTES": "",
    }
    (run_dir / "job.env").write_text("".join(f"export {k}='{v}'\n" for k, v in env_lines.items()))
    node_script = run_dir / "ray-node.sh"
    node_script.write_text(ray_node_script(script))
    node_script.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO),  # miles.job.ports, as the job's python finds it
        "MILES_PORT_CLAIMS_DIR": str(tmp_path / "claims"),
        "STATE": str(state),
        "PLAN": plan,
    }
    proc = subprocess.Popen([str(node_script), "worker", "1", "127.0.0.1"], env=env)
    return proc, run_dir / "logs" / "ray-worker-1.log"


def _attempts(tmp_path: Path) -> int:
    count = tmp_path / "state" / "count"
    return int(count.read_text()) if count.exists() else 0


@pytest.mark.slow
def test_a_start_that_never_joined_is_retried_and_a_signal_reaches_ray(tmp_path: Path) -> None:
    proc, log = _start_worker(tmp_path, "fail join")
    deadline = time.monotonic() + 20
    while "Ray runtime started." not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the second attempt never joined"
        time.sleep(0.1)
    assert _attempts(tmp_path) == 2
    assert "did not join (ray start exit status 1), attempt 1 of 3" in log.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    assert (tmp_path / "state" / "stopped").exists(), "SIGTERM never reached the running ray start"


@pytest.mark.slow
def test_a_node_that_joined_and_died_is_not_restarted(tmp_path: Path) -> None:
    proc, log = _start_worker(tmp_path, "die join")
    assert proc.wait(timeout=20) == 1
    assert _attempts(tmp_path) == 1, log.read_text()


@pytest.mark.slow
def test_retries_are_bounded(tmp_path: Path) -> None:
    proc, log = _start_worker(tmp_path, "fail fail fail join")
    assert proc.wait(timeout=30) == 1
    assert _attempts(tmp_path) == 3, log.read_text()


@pytest.mark.slow
def test_a_pinned_port_in_use_stops_the_node_before_ray_starts_naming_its_preset_key(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # worker 1's node ports are base + 10 .. + 15: its object manager port is the busy one
        proc, log = _start_worker(tmp_path, "join", RAY_NODE_PORT_BASE=port - 11)
        assert proc.wait(timeout=30) != 0
    assert _attempts(tmp_path) == 0, log.read_text()  # `ray start` never ran
    named = f"OBJECT_MANAGER_PORT {port} (ray.node_port_base: something on this node listens on it)"
    assert named in log.read_text(), log.read_text()


def test_the_head_health_check_gives_up_while_it_blocks(tmp_path: Path) -> None:
    """`ray health-check` against a GCS that never started blocks for tens of seconds; the readiness wait's
    check (a `ray start` exited, the deadline) still runs meanwhile, and giving up kills the command."""
    from miles.job.nodes import ray_health_ok

    blocking = tmp_path / "ray"
    blocking.write_text(f"#!/bin/bash\necho $$ >{tmp_path}/pid\nexec sleep 60\n")
    blocking.chmod(0o755)
    checks = []

    def check() -> None:
        checks.append(1)
        if len(checks) == 2:
            raise RuntimeError("process 123 (ray start) exited while waiting for the Ray head")

    with pytest.raises(RuntimeError, match="exited while waiting"):
        ray_health_ok(str(blocking), "127.0.0.1:1", check)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left running
