"""The process harness the megatron CPU tests share: each rank a spawned process in one gloo world."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """This process as `rank` of a gloo world of `world` ranks meeting at 127.0.0.1:`port` (rank 0 hosts)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=rank == 0)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def stop(procs: Sequence[Any]) -> None:
    """Wait a little for each process to end, then kill what is left (a rank stuck in a collective)."""
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@contextlib.contextmanager
def running(procs: Sequence[Any]) -> Iterator[None]:
    """Start `procs`; stop them on the way out, whatever happened."""
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop(procs)
