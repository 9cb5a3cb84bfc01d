"""The weight-update process group, joined identically by trainer rank 0 and every engine.

It never touches torch.distributed's default group: a trainer already running data parallel has its own
default group, and an engine has none. The group is built directly from a TCPStore hosted by rank 0 (the
trainer) at `master_address:master_port`, a PrefixStore keyed by `group_name` (several groups may share a
store), and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) backend object.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

SUPPORTED_BACKENDS = ("gloo", "nccl")


def pick_master_port(host: str = "0.0.0.0") -> int:
    """A port free right now on this host, for rank 0's TCPStore (the OS picks; no fixed ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class GroupHandle:
    """One joined weight-update group. `broadcast` from rank 0 to everyone; `destroy` when done."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    _pg: Any = field(repr=False)
    _store: Any = field(repr=False)

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Post one broadcast; returns the torch Work to `.wait()` on (post several, then wait them all)."""
        if self._pg is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def destroy(self) -> None:
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # gloo has nothing to shut down on some torch builds; dropping the reference frees it

    def abort(self) -> None:
        """Leave at once, without waiting for the peers: for a group whose peer may be dead. A graceful
        NCCL destroy finalizes with the other ranks of the node, which a dead rank never does; an abort
        is local and also ends this rank's in-flight collectives. Only where the data in flight is to be
        thrown away: a failed push (its engines stay PENDING_WEIGHTS) or a group being replaced."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is None:
            return
        leave = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
        if leave is not None:
            try:
                leave()
            except RuntimeError:
                pass  # a backend without abort/shutdown on this build: dropping the reference frees it

    @property
    def alive(self) -> bool:
        return self._pg is not None


def listen_as_master(master_address: str, master_port: int, timeout_s: float = 1800.0) -> Any:
    """Rank 0's store, listening now: pass it to `create_weight_update_group(store=...)` later."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(
        master_address, master_port, None, is_master=True, timeout=timeout, wait_for_workers=False
    )


def create_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout_s: float = 1800.0,
    store: Any = None,
) -> GroupHandle:
    """Join (rank 0: host) the named group; blocks until all `world_size` ranks have joined.

    Rank 0 may pass the `store` it opened earlier with `listen_as_master`: members that connect before
    the master listens back off for about half a second (torch's TCPStore client), so the push opens
    it before asking the engines to join."""
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend must be one of {SUPPORTED_BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port must be a TCP port (1-65535), got {master_port}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    else:
        store.set_timeout(timeout)
    prefixed = dist.PrefixStore(f"miles_weights/{group_name}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        # NCCL connects lazily; a first tiny collective makes the join as blocking as gloo's.
        probe = torch.zeros(1, device=f"cuda:{torch.cuda.current_device()}")
        pg.broadcast([probe], dist.BroadcastOptions()).wait()
    return GroupHandle(group_name, rank, world_size, backend, pg, store)
