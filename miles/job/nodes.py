"""The job script's node steps: `python -m miles.job.nodes probe ...` runs on each node (interface and
prefix modes need the node's own interfaces) and writes its IP; `python -m miles.job.nodes wait-ray ...`
runs on the head after starting Ray and returns once every node of this job joined."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from miles.contract.nodes import NodeIpError, local_ip


def ray_health_ok(ray_bin: str, address: str, check: Callable[[], None] = lambda: None) -> bool:
    """`ray health-check` against the head. Against a GCS that never started the command blocks for tens
    of seconds, so `check` runs every 0.5 s meanwhile: it raises to give up (a `ray start` exited, the
    deadline passed), and the command is killed."""
    argv = [ray_bin, "health-check", "--address", address]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                return proc.wait(timeout=0.5) == 0
            except subprocess.TimeoutExpired:
                check()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def dead_pid(pids: Sequence[int]) -> int | None:
    """The first of `pids` (our children or siblings) that no longer runs."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    return None


def job_nodes_alive(nodes: Sequence[dict], job_label: str | None) -> tuple[int, int]:
    """(alive nodes carrying this job's label resource, all alive nodes) in a `ray.nodes()` answer."""
    alive = [n for n in nodes if n.get("Alive")]
    ours = [n for n in alive if job_label is None or (n.get("Resources") or {}).get(job_label)]
    return len(ours), len(alive)


def wait_for_ray(
    address: str,
    node_ip: str,
    nodes: int,
    timeout_s: float,
    watch: Sequence[int] = (),
    job_label: str | None = None,
) -> int:
    """Poll until Ray reports `nodes` alive nodes of this job; raise TimeoutError/RuntimeError saying why.

    Only nodes carrying `job_label` (a resource every `ray start` of this job advertises) count: a GCS
    of another job answering on the same address must never pass for this job's cluster.
    """
    deadline = time.monotonic() + timeout_s
    ray_bin = str(Path(sys.executable).parent / "ray")

    def check(stage: str) -> None:
        if (pid := dead_pid(watch)) is not None:
            raise RuntimeError(f"process {pid} (ray start) exited while {stage}; see logs/ray-*.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:.0f} s {stage} (ray.start_timeout_s)")

    waiting_for_head = f"waiting for the Ray head at {address}"
    while not ray_health_ok(ray_bin, address, lambda: check(waiting_for_head)):
        check(waiting_for_head)
        time.sleep(0.5)
    import ray  # heavy: only once the head answers

    ray.init(address=address, _node_ip_address=node_ip, logging_level=logging.WARNING, log_to_driver=False)
    try:
        while (counts := job_nodes_alive(ray.nodes(), job_label))[0] < nodes:
            ours, alive = counts
            foreign = (
                f"; {alive - ours} alive node(s) of another cluster answer at {address}"
                if alive > ours
                else ""
            )
            check(f"waiting for {nodes} Ray nodes of this job ({ours} alive{foreign})")
            time.sleep(0.5)
    finally:
        ray.shutdown()
    return counts[0]


@click.group()
def main() -> None:
    """Node helpers run by the job script."""


@main.command()
@click.option("--mode", type=click.Choice(["interface", "prefix", "hostname"]), required=True)
@click.option("--interface", default=None)
@click.option("--prefix", default=None)
@click.option("--name", required=True, help="The scheduler's name of this node.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def probe(mode: str, interface: str | None, prefix: str | None, name: str, out: Path) -> None:
    """Write this node's IP to OUT/NAME (OUT is on the shared file system)."""
    try:
        ip = local_ip(mode, interface, prefix)
    except NodeIpError as exc:
        raise click.ClickException(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    tmp.write_text(f"{name} {ip}\n")
    tmp.replace(out / name)  # atomic: the head never reads half a line


@main.command("wait-ray")
@click.option("--address", required=True, help="HEAD_IP:GCS_PORT")
@click.option("--node-ip", required=True, help="The head's node IP (the driver connects as it).")
@click.option("--nodes", type=int, required=True)
@click.option("--timeout", type=float, required=True)
@click.option("--watch-pid", type=int, multiple=True, help="Fail fast if this ray start process exits.")
@click.option("--job-label", default=None, help="Count only nodes advertising this resource (this job's).")
def wait_ray(
    address: str, node_ip: str, nodes: int, timeout: float, watch_pid: tuple[int, ...], job_label: str | None
) -> None:
    """Exit 0 once Ray reports NODES alive nodes of this job; non-zero with a reason otherwise."""
    started = time.monotonic()
    try:
        alive = wait_for_ray(address, node_ip, nodes, timeout, watch_pid, job_label)
    except (TimeoutError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"ray: {alive} nodes alive after {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
