"""The hybrid lanes' own process group, one per membership epoch, never the core trainer's.

The core trainer's default group (miles/train/worker.py) is built once at startup and never rebuilt. The
lanes' group is a separate ProcessGroupGloo over a TCPStore hosted by the core lane, and each membership
epoch gets a fresh group under its own store prefix (`miles_hybrid/<run>/epoch-<n>`), so a group of an
old epoch can never meet a member of a new one. Collectives go through the group object directly: it is
not registered with torch.distributed, so the default group's functional API never sees it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

STORE_PREFIX = "miles_hybrid"


@dataclass(frozen=True)
class Membership:
    """Who is in the lanes' group for one epoch; a lane's rank is its position (the core lane is first)."""

    run: str
    epoch: int
    lanes: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ValueError(f"membership epoch must be >= 0, got {self.epoch}")
        if not self.lanes or len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"a membership needs unique lanes, got {self.lanes}")

    def rank_of(self, lane: str) -> int:
        if lane not in self.lanes:
            raise ValueError(f"lane {lane!r} is not a member of epoch {self.epoch} ({', '.join(self.lanes)})")
        return self.lanes.index(lane)

    @property
    def prefix(self) -> str:
        return f"{STORE_PREFIX}/{self.run}/epoch-{self.epoch}"


def open_store(host: str, timeout_s: float) -> torch_dist.TCPStore:
    """The core lane's store (the OS picks the port), shared by every epoch through prefixes."""
    return torch_dist.TCPStore(
        host, 0, None, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def connect_store(host: str, port: int, timeout_s: float) -> torch_dist.TCPStore:
    return torch_dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))


class LaneGroup:
    """One epoch's gloo group; blocks in the constructor until every member has joined (or times out)."""

    def __init__(self, store: Any, membership: Membership, lane: str, timeout_s: float) -> None:
        self.membership = membership
        self.rank = membership.rank_of(lane)
        self.size = len(membership.lanes)
        prefixed = torch_dist.PrefixStore(membership.prefix, store)
        self._pg = torch_dist.ProcessGroupGloo(prefixed, self.rank, self.size, timedelta(seconds=timeout_s))

    # Collectives run on host copies of device tensors: gloo's own CUDA paths differ per collective, and
    # a lane on a borrowed GPU has no NCCL group with the core (one could be kept per epoch: a next step).

    def all_reduce_sum(self, flat: torch.Tensor) -> None:
        options = torch_dist.AllreduceOptions()
        options.reduceOp = torch_dist.ReduceOp.SUM
        host = flat.cpu()
        self._pg.allreduce([host], options).wait()
        if host is not flat:
            flat.copy_(host)

    def all_gather(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `row` (same shape and dtype everywhere), in rank order, on `row`'s device."""
        host = row.cpu()
        out = [torch.empty_like(host) for _ in range(self.size)]
        self._pg.allgather([out], [host]).wait()
        return [t.to(row.device) for t in out]

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        options = torch_dist.BroadcastOptions()
        options.rootRank = root
        host = tensor.cpu()
        self._pg.broadcast([host], options).wait()
        if host is not tensor:
            tensor.copy_(host)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for target in targets:
            numel = target.numel()
            target.copy_(flat[offset : offset + numel].view_as(target).to(target.dtype))
            offset += numel


# (a contiguous tensor, start, end): a range of its flattened elements
Segment = tuple[torch.Tensor, int, int]


def chunk_segments(tensors: Sequence[torch.Tensor], max_elements: int) -> Iterator[list[Segment]]:
    """`tensors`' elements in order, in chunks of at most `max_elements` (a large tensor is cut across
    chunks), so each chunk's gathered copy is bounded. Every replica holding tensors of the same shapes
    cuts them alike."""
    chunk: list[Segment] = []
    room = max_elements
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("chunked sums need contiguous tensors (written back through views)")
        start, numel = 0, tensor.numel()
        while start < numel:
            take = min(numel - start, room)
            chunk.append((tensor, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                yield chunk
                chunk, room = [], max_elements
    if chunk:
        yield chunk


def gather_segments(segments: Sequence[Segment]) -> torch.Tensor:
    """One fp32 tensor of the segments' elements, in order."""
    return torch.cat([tensor.view(-1)[start:end].to(torch.float32) for tensor, start, end in segments])


def scatter_segments(flat: torch.Tensor, segments: Sequence[Segment]) -> None:
    """gather_segments' inverse: each segment takes its elements of `flat` (cast to its dtype)."""
    offset = 0
    with torch.no_grad():
        for tensor, start, end in segments:
            tensor.view(-1)[start:end].copy_(flat[offset : offset + end - start])
            offset += end - start
