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

from launcher.ports import (
    PortError,
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
