"""Ports for tests that pin a job's ports in its preset (`ray.gcs_port`, `ray.node_port_base`, ...).

A pinned port must still be free when the job's node claims it, a second or more after the test picked it.
The kernel's ephemeral range (32768-60999 here) is where every outgoing connection and every `port 0`
listener (Ray's idle workers, the trainer's command channels) lands, so a port picked there can be taken
in between; the jobs' own picks use 20000-32767, Ray's default worker ports 10002-19999, and the system
tests' port plans 7000-9899 (tests/system/helpers/jobtools.py). So each module here picks from its own
part of 2000-6999, where nothing else binds, and keeps off the ports a scheduler daemon owns on a real
cluster (slurmctld's 6817-6819): the preset check refuses them even where no daemon listens on this host.
"""

from __future__ import annotations

import os

from miles.contract.ports import SCHEDULER_DAEMON_PORTS, port_free

# one span per test module that pins ports, so two such modules on two xdist workers never pick alike
RENDER_LOCAL_RUN = range(2000, 4500)
CLI_JOBS_LOCAL = range(4500, 7000)


def free_block(size: int, span: range) -> int:
    """A base such that base..base+size-1 lie in `span`, miss the scheduler daemons' ports and are all free on
    this host now, on any address
    (the search starts at a place this process's id picks, so concurrent runs tend to differ)."""
    step = size + 7
    bases = list(range(span.start, span.stop - size, step))
    if not bases:
        raise ValueError(f"a block of {size} ports does not fit in {span}")
    first = os.getpid() % len(bases)
    for base in bases[first:] + bases[:first]:
        block = range(base, base + size)
        if not SCHEDULER_DAEMON_PORTS.keys() & set(block) and all(map(port_free, block)):
            return base
    raise RuntimeError(f"no {size} free ports together in {span.start}-{span.stop - 1}")
