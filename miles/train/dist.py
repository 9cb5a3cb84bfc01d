"""Data parallel helpers: the rank's share of a batch, gathering per-datum outputs (the gradient all-reduce
is optim_step's: miles/train/backends/optim_guard.py).

Every rank receives the same full batch and takes a contiguous share of complete datums. Losses are sums
(see losses.py), so summing the ranks' gradients reproduces the single-rank gradient exactly; a rank whose
share is empty contributes zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as torch_dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """One rank's place in an already initialised torch.distributed group."""

    rank: int
    world_size: int
    group: Any = None  # a ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad DistContext: rank {self.rank} of world size {self.world_size}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def share_bounds(num_items: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s contiguous share; the first `num_items % world_size` ranks take one more."""
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def local_share(items: Sequence[T], dist: DistContext | None) -> list[T]:
    if dist is None or dist.world_size == 1:
        return list(items)
    start, end = share_bounds(len(items), dist.world_size, dist.rank)
    return list(items[start:end])


def gather_shares(local: list[T], dist: DistContext | None) -> list[T]:
    """Concatenate every rank's list in rank order (= the original batch order for contiguous shares)."""
    if dist is None or dist.world_size == 1:
        return local
    gathered: list[list[T] | None] = [None] * dist.world_size
    torch_dist.all_gather_object(gathered, local, group=dist.group)
    return [item for part in gathered for item in (part or [])]


def barrier(dist: DistContext | None) -> None:
    if dist is not None and dist.world_size > 1:
        torch_dist.barrier(group=dist.group)
