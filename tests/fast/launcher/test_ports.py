"""Per-job port claims: two jobs starting at once on one node never get the same port, a port something
already listens on is never picked, and a claim ends with its owner process."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from miles.contract.ports import (
    PORT_RANGE,
    PortError,
    claim_port,
    claim_ports,
    live_claims,
    pick,
    port_free,
    read_port_files,
    shell_lines,
)

NODE_PORTS = ["NODE_MANAGER_PORT", "OBJECT_MANAGER_PORT", "AGENT_LISTEN_PORT"]


def test_concurrent_claims_on_one_node_never_overlap(tmp_path: Path) -> None:
    def claim(_: int) -> set[int]:
        return claim_ports(os.getpid(), NODE_PORTS, {"WORKER_PORT": 50}, claims_dir=tmp_path).taken()

    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(claim, range(16)))
    everything = [port for taken in claims for port in taken]
    assert len(everything) == 16 * (3 + 50) and len(set(everything)) == len(everything)
    assert len(live_claims(tmp_path)) == 16


def test_a_claim_ends_with_its_owner(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        claim = claim_ports(owner.pid, ["GCS"], {}, claims_dir=tmp_path)
        assert [c.ports for c in live_claims(tmp_path)] == [claim.ports]
    finally:
        owner.kill()
        owner.wait()
    assert live_claims(tmp_path) == [] and list(tmp_path.glob("*.json")) == []  # the stale file is gone
    with pytest.raises(PortError, match="does not run"):
        claim_ports(owner.pid, ["GCS"], {}, claims_dir=tmp_path)


def test_a_listening_port_is_never_picked() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert not port_free(taken)
        with pytest.raises(PortError, match=f"no free port for GCS in {taken}-{taken}"):
            pick(["GCS"], {}, set(), random.Random(0), bounds=(taken, taken + 1))  # the only candidate
    assert pick(["GCS"], {}, set(), random.Random(0), bounds=(taken, taken + 1))[0] == {"GCS": taken}


def test_claimed_ports_are_skipped_and_exhaustion_is_named() -> None:
    rng = random.Random(1)
    ports, ranges = pick(["A"], {"W": 4}, {20000, 20001}, rng, free=lambda _: True, bounds=(20000, 20008))
    used = {ports["A"], *range(ranges["W"][0], ranges["W"][1] + 1)}
    assert not used & {20000, 20001} and len(used) == 5
    with pytest.raises(PortError, match="no 9 free contiguous ports for W in 20000-20007"):
        pick([], {"W": 9}, set(), rng, free=lambda _: True, bounds=(20000, 20008))


def test_port_files_round_trip_for_status(tmp_path: Path) -> None:
    claim = claim_ports(os.getpid(), ["GCS"], {"WORKER_PORT": 16}, claims_dir=tmp_path / "claims")
    (tmp_path / "ports").mkdir()
    (tmp_path / "ports" / "node-0.env").write_text(shell_lines(claim))
    found = read_port_files(tmp_path / "ports")["node-0"]
    assert found["GCS"] == claim.ports["GCS"]
    assert found["WORKER_PORT_MAX"] - found["WORKER_PORT_MIN"] == 15


def test_pinned_ports_are_checked_named_with_their_preset_key_and_claimed(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        listening = busy.getsockname()[1]
        with pytest.raises(
            PortError, match=rf"RAY_GCS_PORT {listening} \(ray.gcs_port: something on this node"
        ):
            claim_ports(os.getpid(), ["GATEWAY_PORT"], {}, claims, fixed={"RAY_GCS_PORT": listening})
    assert live_claims(claims) == []  # a refused claim records nothing

    pinned = free_port_span(8)
    first = claim_ports(
        os.getpid(),
        ["GATEWAY_PORT"],
        {},
        claims,
        fixed={"NODE_MANAGER_PORT": pinned[0]},
        fixed_ranges={"WORKER_PORT": (pinned[1], pinned[-1])},
    )
    assert first.ports["NODE_MANAGER_PORT"] == pinned[0] and first.ranges["WORKER_PORT"] == (
        pinned[1],
        pinned[-1],
    )
    assert first.ports["GATEWAY_PORT"] not in pinned
    assert f"NODE_MANAGER_PORT={pinned[0]}\n" in shell_lines(first)
    # another job pinning a port inside that range is refused, naming the key that pins it
    with pytest.raises(PortError, match=rf"WORKER_PORT {pinned[3]} \(ray.worker_port_base: another job"):
        claim_ports(os.getpid(), [], {}, claims, fixed_ranges={"WORKER_PORT": (pinned[3], pinned[3] + 50)})


def test_a_port_claimed_for_a_later_server_lies_below_the_ephemeral_range_and_keeps_jobs_off(
    tmp_path: Path,
) -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [claim_port("GATEWAY_PORT", tmp_path) for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(PORT_RANGE[0] <= p < min(PORT_RANGE[1], ephemeral_low) for p in ports)
    claims = live_claims(tmp_path)
    assert {claim.owner_pid for claim in claims} == {os.getpid()}
    assert {p for claim in claims for p in claim.taken()} == set(ports)
    # a job that pins one of them is told another claim holds it, before anything binds it
    with pytest.raises(PortError, match=rf"GATEWAY_PORT {ports[0]} \(gateway.port: another job"):
        claim_ports(os.getpid(), [], {}, tmp_path, fixed={"GATEWAY_PORT": ports[0]})
    job = claim_ports(os.getpid(), ["RAY_GCS_PORT"], {"WORKER_PORT": 50}, tmp_path)
    assert not job.taken() & set(ports)


def free_port_span(size: int) -> list[int]:
    """`size` consecutive ports nothing listens on (below the ephemeral range)."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000)
        if all(port_free(p) for p in range(first, first + size)):
            return list(range(first, first + size))
    raise AssertionError("no free span of ports")


@pytest.mark.parametrize(
    "option", ["--fixed=GCS", "--fixed=GCS=0", "--fixed==80", "--fixed-range=W=9-8", "--range=W:x"]
)
def test_malformed_port_options_are_usage_errors(tmp_path: Path, option: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.job.ports",
            "--owner",
            str(os.getpid()),
            option,
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "MILES_PORT_CLAIMS_DIR": str(tmp_path / "claims")},
    )
    assert done.returncode == 2 and "expected NAME" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


def test_a_pinned_port_lingering_in_time_wait_is_free_for_a_server_but_never_picked(tmp_path: Path) -> None:
    """A job restarted on its pinned ports finds the last run's connections in TIME_WAIT: Ray and uvicorn
    bind over those (SO_REUSEADDR), so the claim must too; picks, with ports to spare, still avoid them."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    assert not port_free(port)
    claim = claim_ports(os.getpid(), [], {}, tmp_path / "claims", fixed={"RAY_GCS_PORT": port})
    assert claim.ports == {"RAY_GCS_PORT": port}
