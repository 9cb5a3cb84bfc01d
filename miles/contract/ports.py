"""Per-job ports, picked free on the node that binds them and claimed there while their owner lives.

The job script claims through `python -m miles.job.ports` (the command line; this module is the logic)
on the head (GCS, Ray client, gateway) and on every node (Ray's node ports and a worker port range)
before `ray start`, and the runtime claims an engine's port the same way. A claim is a file in a
node-local directory, written under a lock: two jobs starting on one node at the same moment never pick
the same port, and a port a live process already listens on is never picked. A claim ends when
its owner process (the job script, or the node script that runs `ray start`) is gone.

Ports a preset pins (`ray.gcs_port`, `ray.node_port_base`, ...) go through the same claim: each must be
free on the node and held by no other live claim, or the job stops at once, naming the port and the preset
key to change. Without that check Ray says only, 30 s later, that the node "timed out during startup".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles.contract.procs import process_start_ticks

CLAIMS_DIR_ENV = "MILES_PORT_CLAIMS_DIR"
DEFAULT_CLAIMS_DIR = "/tmp/miles-port-claims"
# Below Linux's ephemeral range (32768-60999): a port picked now and bound seconds later must not be
# taken meanwhile by some process's outgoing connection.
PORT_RANGE = (20000, 32768)
ATTEMPTS = 2000

# Ports the schedulers' own daemons listen on, on every node of a cluster (0.0.0.0): a fixed port plan
# must keep off them. A Ray node port on one of them fails to bind, and Ray only says, 30 s later, that
# the node "timed out during startup" (seen in CI: node ports from 17000 met pbs_comm on 17001).
SCHEDULER_DAEMON_PORTS = {
    15001: "PBS Professional's pbs_server",
    15002: "PBS Professional's pbs_mom",
    15003: "PBS Professional's pbs_mom (resource monitor)",
    15004: "PBS Professional's pbs_sched",
    15007: "PBS Professional's data service",
    17001: "PBS Professional's pbs_comm",
    6817: "slurmctld",
    6818: "slurmd",
    6819: "slurmdbd",
}
NODE_PORTS = 6  # node manager, object manager, agent listen, agent gRPC, runtime env agent, metrics
NODE_PORT_STRIDE = 10  # node i's ports start at node_port_base + 10 i (templates/common/ray_node.sh.j2)


def fixed_node_ports(node_port_base: int, nodes: int) -> list[int]:
    """The Ray node ports a fixed `ray.node_port_base` pins on `nodes` nodes."""
    return [node_port_base + NODE_PORT_STRIDE * i + k for i in range(nodes) for k in range(NODE_PORTS)]


def daemon_port_clashes(ports: Sequence[int]) -> list[str]:
    """'PORT (daemon)' for each of `ports` that a scheduler daemon listens on."""
    clashing = sorted(set(ports) & SCHEDULER_DAEMON_PORTS.keys())
    return [f"{port} ({SCHEDULER_DAEMON_PORTS[port]})" for port in clashing]


# The preset key that pins each port name the job scripts use (a Ray node port: ray.node_port_base).
PRESET_KEYS = {
    "RAY_GCS_PORT": "ray.gcs_port",
    "RAY_CLIENT_PORT": "ray.client_server_port",
    "GATEWAY_PORT": "gateway.port",
    "WORKER_PORT": "ray.worker_port_base",
}


def preset_key(name: str) -> str:
    return PRESET_KEYS.get(name, "ray.node_port_base")


class PortError(RuntimeError):
    """No free ports could be claimed; the message says where it looked."""


@dataclass(frozen=True)
class Claim:
    owner_pid: int
    owner_start: int | None
    ports: dict[str, int]
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (first, last)

    def taken(self) -> set[int]:
        spans = (range(first, last + 1) for first, last in self.ranges.values())
        return set(self.ports.values()).union(*spans)


def claim_alive(claim: Claim) -> bool:
    start = process_start_ticks(claim.owner_pid)
    return start is not None and (claim.owner_start is None or start == claim.owner_start)


def port_free(port: int, *, reuse: bool = False) -> bool:
    """Nothing on this node listens on (or holds) the port, on any address. `reuse`: bind as the servers
    that will take a pinned port do (Ray's gRPC, uvicorn: SO_REUSEADDR), so a connection of an earlier run
    lingering in TIME_WAIT does not count; a listener still does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def pinned_port_free(port: int) -> bool:
    return port_free(port, reuse=True)


def busy_fixed(
    fixed: dict[str, int],
    fixed_ranges: dict[str, tuple[int, int]],
    taken: set[int],
    free: Callable[[int], bool] = pinned_port_free,
) -> list[str]:
    """'NAME PORT (preset key: why)' for each pinned port, or the first busy port of a pinned range, that
    another live claim holds or something on this node listens on."""
    spans = {name: (port, port) for name, port in fixed.items()} | fixed_ranges
    busy = []
    for name, (first, last) in spans.items():
        for port in range(first, last + 1):
            why = "another job on this node claimed it" if port in taken else None
            if why is None and not free(port):
                why = "something on this node listens on it"
            if why:
                busy.append(f"{name} {port} ({preset_key(name)}: {why})")
                break
    return busy


def pick(
    names: Sequence[str],
    ranges: dict[str, int],
    taken: set[int],
    rng: random.Random,
    free: Callable[[int], bool] = port_free,
    bounds: tuple[int, int] = PORT_RANGE,
) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """Ports for `names` and contiguous ranges (name -> size), none in `taken` and each `free`."""
    used = set(taken)
    picked_ranges: dict[str, tuple[int, int]] = {}
    for name, size in ranges.items():
        for _ in range(ATTEMPTS if bounds[1] - size > bounds[0] else 0):
            first = rng.randrange(bounds[0], bounds[1] - size)
            span = range(first, first + size)
            if not used.intersection(span) and all(free(p) for p in span):
                picked_ranges[name] = (first, first + size - 1)
                used.update(span)
                break
        else:
            raise PortError(
                f"no {size} free contiguous ports for {name} in {bounds[0]}-{bounds[1] - 1}: lower "
                "ray.worker_ports_per_node, or pin the range (ray.worker_port_base) where this node has room"
            )
    picked: dict[str, int] = {}
    for name in names:
        for _ in range(ATTEMPTS):
            port = rng.randrange(*bounds)
            if port not in used and free(port):
                picked[name] = port
                used.add(port)
                break
        else:
            raise PortError(
                f"no free port for {name} in {bounds[0]}-{bounds[1] - 1}: this node's ports are taken; "
                "pin the job's ports in the preset (ray.gcs_port, ray.node_port_base, gateway.port)"
            )
    return picked, picked_ranges


@contextlib.contextmanager
def locked(claims_dir: Path) -> Iterator[None]:
    claims_dir.mkdir(mode=0o1777, parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        claims_dir.chmod(0o1777)  # every user's jobs claim here; each removes only its own files
    with open(claims_dir / ".lock", "a") as lock:
        with contextlib.suppress(PermissionError):
            os.chmod(lock.name, 0o666)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def node_claims_dir() -> Path:
    """Where this node's claims live: `$MILES_PORT_CLAIMS_DIR`, else /tmp/miles-port-claims."""
    return Path(os.environ.get(CLAIMS_DIR_ENV) or DEFAULT_CLAIMS_DIR)


def claimed_ports(claims_dir: Path | None = None) -> set[int]:
    """Every port a live claim holds (outside the lock: a snapshot, for a caller that only avoids them)."""
    return set().union(*(claim.taken() for claim in live_claims(claims_dir or node_claims_dir())))


def live_claims(claims_dir: Path) -> list[Claim]:
    """Claims whose owner still runs; the files of ended owners are removed when we may."""
    claims = []
    for path in claims_dir.glob("*.json"):
        try:
            data = json.loads(path.read_text())
            claim = Claim(
                data["owner_pid"],
                data["owner_start"],
                data["ports"],
                {k: (v[0], v[1]) for k, v in data["ranges"].items()},
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if claim_alive(claim):
            claims.append(claim)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return claims


def claim_ports(
    owner_pid: int,
    names: Sequence[str],
    ranges: dict[str, int],
    claims_dir: Path | None = None,
    *,
    fixed: dict[str, int] | None = None,
    fixed_ranges: dict[str, tuple[int, int]] | None = None,
) -> Claim:
    """Pick and record free ports for `owner_pid` on this node, with the ports the preset pins (`fixed`,
    `fixed_ranges`: checked free and unclaimed, else PortError naming each and its preset key)."""
    claims_dir = claims_dir or node_claims_dir()
    fixed, fixed_ranges = fixed or {}, fixed_ranges or {}
    start = process_start_ticks(owner_pid)
    if start is None:
        raise PortError(f"owner process {owner_pid} does not run")
    with locked(claims_dir):
        taken = claimed_ports(claims_dir)
        if busy := busy_fixed(fixed, fixed_ranges, taken):
            raise PortError(
                f"ports the preset pins are in use on {socket.gethostname()}: {'; '.join(busy)}. Pin other "
                "values, or leave them unset so the job picks free ports"
            )
        pinned = Claim(owner_pid, start, fixed, fixed_ranges).taken()
        ports, picked_ranges = pick(names, ranges, taken | pinned, random.Random())
        claim = Claim(owner_pid, start, fixed | ports, fixed_ranges | picked_ranges)
        record = {"owner_pid": owner_pid, "owner_start": start, "ports": claim.ports, "ranges": claim.ranges}
        path = claims_dir / f"{owner_pid}-{start}-{os.urandom(3).hex()}.json"
        path.write_text(json.dumps(record) + "\n")
    return claim


def claim_port(name: str = "PORT", claims_dir: Path | None = None) -> int:
    """One free port below the ephemeral range, claimed for this process while it lives: for a server that
    another process binds later (an engine, seconds or minutes after; a gateway after Ray's bring-up).
    A port the OS picks (`bind(("", 0))`) lies in the ephemeral range, where any outgoing connection or
    `port 0` listener can take it in between (seen in CI: a test gateway's port taken during Ray's start)."""
    return claim_ports(os.getpid(), [name], {}, claims_dir).ports[name]


def shell_lines(claim: Claim) -> str:
    """`NAME=port` lines (a range gives NAME_MIN and NAME_MAX) for the job script to source."""
    lines = [f"{name}={port}" for name, port in claim.ports.items()]
    for name, (first, last) in claim.ranges.items():
        lines += [f"{name}_MIN={first}", f"{name}_MAX={last}"]
    return "\n".join(lines) + "\n"


def read_port_files(ports_dir: Path) -> dict[str, dict[str, int]]:
    """`launcher status`: every `<who>.env` the job wrote under RUN_DIR/ports, as numbers."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted(ports_dir.glob("*.env")) if ports_dir.is_dir() else []:
        values = {}
        for line in path.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and value.strip().isdigit():
                values[name.strip()] = int(value)
        found[path.stem] = values
    return found
