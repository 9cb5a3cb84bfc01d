"""The launcher tests' port picker keeps off the ports the preset check refuses."""

from __future__ import annotations

from unittest import mock

from miles.contract.ports import SCHEDULER_DAEMON_PORTS
from tests.fast.launcher.pinned_ports import CLI_JOBS_LOCAL, free_block


def test_no_start_point_picks_a_block_over_a_scheduler_daemon_port() -> None:
    size = 113
    for pid in range(0, 40):
        with mock.patch("os.getpid", return_value=pid):
            base = free_block(size, CLI_JOBS_LOCAL)
        assert not SCHEDULER_DAEMON_PORTS.keys() & set(range(base, base + size)), (pid, base)
