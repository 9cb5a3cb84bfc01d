"""Helpers for the system tests: the Slurm check, a test preset, running the launcher, waiting."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from miles.contract.ports import claimed_ports, fixed_node_ports, port_free

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[2]
# the console script next to this python: what operators run
LAUNCHER = [str(Path(sys.executable).with_name("launcher"))]


def slurm_unavailable() -> str | None:
    """Why the local Slurm cluster cannot be used, or None when it can."""
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is unset: run ../shared/slurm-local/start-slurm.sh and source its env.sh"
    if shutil.which("sbatch") is None:
        return "sbatch is not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0:
        return f"the Slurm cluster does not answer: {out.stderr.strip() or out.stdout.strip()}"
    usable = sum(
        int(line.split()[0])
        for line in out.stdout.splitlines()
        if line.split()[1] in ("idle", "mix", "alloc")
    )
    if usable < 3:
        return f"the local Slurm cluster needs 3 usable nodes (sinfo: {out.stdout.strip()!r})"
    return None


# Below Linux's ephemeral range (32768-60999): a port picked now and bound seconds later by the job
# must not be taken meanwhile by some process's outgoing connection or an OS-assigned listener.
LOW_PORTS = (20000, 32000)


def free_port() -> int:
    """A port below the ephemeral range, free now and claimed by no one: a port the preset pins, which the
    job's own claim refuses when another live claim (a test's gateway on the other xdist worker) holds it."""
    claimed = claimed_ports()
    for _ in range(200):
        port = random.randrange(*LOW_PORTS)
        if port not in claimed and port_free(port):
            return port
    raise RuntimeError(f"no free port in {LOW_PORTS}")


# A fixed Ray port plan (node i: node base + 10 i .. + 5, worker ports worker base + 100 i .. + 99) lies
# below Ray's default worker port range (10002-19999): the local Ray clusters other tests start meanwhile
# (ray.init, in this process or the other xdist worker) listen there. The kits' daemons listen in this
# host's low ports too (slurm-local's slurmctld/slurmd on 16817-16820, PBS on 15001-15023, 17001; none of
# the scheduler daemons' fixed ports, which presets may not pin, lies in these ranges), so a plan is taken
# only where every one of its ports is free right now.
NODE_BASES = range(7000, 8400, 100)
WORKER_BASES = range(8500, 9700, 100)
WORKER_PORTS_PER_NODE = 100


def fixed_port_plan(nodes: int) -> tuple[int, int]:
    """(node_port_base, worker_port_base) whose ports are all free on this host now and claimed by no live
    job: the previous test's job may still be tearing down, its worker range claimed but not yet bound."""
    claimed = claimed_ports()

    def usable(ports: Iterable[int]) -> bool:
        return all(port not in claimed and port_free(port) for port in ports)

    node_bases = [b for b in NODE_BASES if usable(fixed_node_ports(b, nodes))]
    span = WORKER_PORTS_PER_NODE * nodes
    worker_bases = [b for b in WORKER_BASES if usable(range(b, b + span))]
    if not node_bases or not worker_bases:
        raise RuntimeError(f"no free fixed Ray port plan for {nodes} nodes in {NODE_BASES} / {WORKER_BASES}")
    return random.choice(node_bases), random.choice(worker_bases)


def system_preset(
    name: str, nodes: int, train_nodes: int, scheduler_extra: dict[str, Any] | None = None
) -> dict:
    """A preset for system jobs: the fake driver, a private Ray port plan, short probe intervals."""
    node_base, worker_base = fixed_port_plan(nodes)
    return {
        "name": name,
        "nodes": nodes,
        "train_nodes": train_nodes,
        "gpus_per_node": 2,  # logical: Ray advertises them, Slurm is asked for none
        "scheduler": {"slurm": {"gpus_per_node": 0, "time": "00:05:00"}, "pbs": {"walltime": "00:05:00"}}
        | (scheduler_extra or {}),
        "model": {"name": "tiny-qwen3", "init": "tiny"},
        "engines": {"kind": "cpu"},
        "gateway": {"host": "0.0.0.0", "port": free_port()},
        "watchdog": {
            "dead_probes": 2,
            "probe_interval_s": 0.5,
            "startup_probe_interval_s": 0.5,
            "startup_timeout_s": 90,
        },
        "ray": {
            "gcs_port": free_port(),
            "client_server_port": free_port(),
            "node_port_base": node_base,
            "worker_port_base": worker_base,
            "worker_ports_per_node": WORKER_PORTS_PER_NODE,
            "temp_dir": f"/tmp/mr-{random.randrange(16**6):06x}",
            "num_cpus": 1,
            "object_store_memory_mb": 80,
            "start_timeout_s": 120,
            "node_ip": {"mode": "loopback-index"},
        },
        "env": {"OMP_NUM_THREADS": "1"},
        "driver": {"command": [sys.executable, str(HELPERS / "fake_driver.py")]},
    }


def launcher(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env
    )


def launcher_json(*args: str, env: dict[str, str] | None = None) -> Any:
    result = launcher(*args, "--json", env=env)
    assert result.returncode == 0, f"launcher {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def run_logs(run_dir: Path) -> str:
    """Every log of a run, for assertion messages."""
    parts = []
    # catalog instances log under logs/<instance>/
    files = sorted(p for p in (run_dir / "logs").rglob("*") if p.is_file())
    for path in files + sorted(run_dir.glob("job.sh.*")):
        parts.append(f"==> {path.name} <==\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)
