"""Node identity helpers the job script runs: choose a node's IP, wait until Ray reports every node.

`python -m launcher.nodes probe ...` runs on each node (interface/prefix modes need the node's own
interfaces); `python -m launcher.nodes wait-ray ...` runs on the head after starting Ray.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
REMOTE_IP_MODES = ("interface", "prefix")  # need a probe on each node


class NodeIpError(ValueError):
    """A node's IP cannot be chosen as the preset asks."""


def loopback_ip(index: int) -> str:
    """TEST MODE: node `index` of the allocation -> 127.0.0.(2+index) (Ray rewrites 127.0.0.1)."""
    if not 0 <= index <= 252:
        raise NodeIpError(f"loopback-index mode supports at most 253 nodes, got index {index}")
    return f"127.0.0.{2 + index}"


def hostname_ip(name: str) -> str:
    """The first IPv4 address a node name resolves to."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NodeIpError(
            f"node name {name!r} does not resolve ({exc}); use ray.node_ip mode interface or prefix "
            "(or loopback-index when every node is this one host)"
        ) from None
    return str(infos[0][4][0])


def interface_ip(interface: str) -> str:
    """The IPv4 address of a local network interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            raise NodeIpError(
                f"interface {interface!r} has no IPv4 address on {socket.gethostname()} "
                f"(interfaces: {', '.join(local_interfaces())})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def local_interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def local_ipv4s() -> dict[str, str]:
    """Interface name -> IPv4 address for every local interface that has one."""
    found = {}
    for name in local_interfaces():
        try:
            found[name] = interface_ip(name)
        except NodeIpError:
            continue
    return found


def pick_by_prefix(addresses: Sequence[str], prefix: str) -> str:
    """The lowest address starting with `prefix` (deterministic when a node has several)."""
    matches = sorted(
        (a for a in addresses if a.startswith(prefix)), key=lambda a: int(ipaddress.ip_address(a))
    )
    if not matches:
        raise NodeIpError(
            f"no IPv4 address of {socket.gethostname()} starts with {prefix!r} (has: {', '.join(addresses)})"
        )
    return matches[0]


def local_ip(mode: str, interface: str | None = None, prefix: str | None = None) -> str:
    """This node's IP for the interface/prefix/hostname modes."""
    if mode == "interface":
        return interface_ip(interface or "")
    if mode == "prefix":
        return pick_by_prefix(list(local_ipv4s().values()), prefix or "")
    if mode == "hostname":
        return hostname_ip(socket.gethostname())
    raise NodeIpError(f"mode {mode!r} cannot be probed on a node")


def node_ips(
    entries: Sequence[tuple[str, str | None]], mode: str, resolve: Callable[[str], str] = hostname_ip
) -> list[tuple[str, str]]:
    """Give every (name, ip-or-None) entry an IP: given IPs win; otherwise per `mode`."""
    result = []
    for index, (name, ip) in enumerate(entries):
        if ip is None:
            if mode == "loopback-index":
                ip = loopback_ip(index)
            elif mode == "hostname":
                ip = resolve(name)
            else:
                raise NodeIpError(
                    f"node {name}: ip mode {mode!r} needs the IP in the node file ('NAME IP'); the job "
                    "script collects it by probing each node"
                )
        result.append((name, ip))
    return result


# ---------------------------------------------------------------- Ray readiness


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

    ray.init(address=address, _node_ip_address=node_ip, logging_level="WARNING", log_to_driver=False)
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
