"""What a hybrid lane needs of its trainer backend, per backend: the step's gradient as one flat buffer, the
step on the summed buffer, the state that must be equal on every lane, and the copy a joiner gets.

- transformers: every lane holds the whole trainable state (parameters and AdamW's moments and steps) as
  plain tensors (state.py); a lane clips by the norm it measures itself on the summed buffer.
- megatron (full fine-tuning, TP 1): the core's distributed optimizer cuts the fp32 main weights and the
  moments over its DP ranks, so the state is gathered whole over the core's DP group first
  (megatron/zero_state.py: a collective of every core rank, which is why a megatron core runs the state
  calls on every rank), and the step clips by one norm the lanes' rank 0 measured on the summed buffer: a
  core rank measuring its shards and a lane measuring the whole would differ in the last bits.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from miles.train.backends.base import DataParallel, TrainBackend
from miles.train.dist import DistContext
from miles.train.hybrid import state
from miles.train.hybrid.group import LaneGroup
from miles.types import AdamParams

Entries = list[tuple[str, torch.Tensor]]


class Replica(Protocol):
    # the step clips by a norm every replica is handed (measured once), not by its own measurement
    shared_norm: bool

    def core_dist(self) -> DistContext | None:
        """The core's data-parallel group when this is a core of several ranks; else None."""
        ...

    def gradients(self, key: str) -> list[torch.Tensor]:
        """The tensors the step's gradient accumulates in (contiguous), in parameter order: summed over
        the replicas in place, chunk by chunk."""
        ...

    def step(self, key: str, adam: AdamParams, grad_norm: float | None, *, core: bool) -> dict[str, float]:
        """The step on the summed gradients (in place); `core`: a core of several ranks, already summed."""
        ...

    def drop_gradients(self, key: str) -> None: ...

    def state_entries(self, key: str) -> Entries | None:
        """(name, tensor) of the whole state in a fixed order; None on a core rank other than 0."""
        ...

    def broadcast_state(self, group: LaneGroup | None, key: str, root: int) -> None:
        """Every lanes' group member ends with the root's state (`group` None: a core rank other than 0,
        which only takes part in the core's own collectives)."""
        ...


class TransformersReplica:
    shared_norm = False

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def core_dist(self) -> DistContext | None:
        dist = self.backend.dist if isinstance(self.backend, DataParallel) else None
        return dist if dist is not None and dist.world_size > 1 else None

    def _params(self, key: str) -> list[torch.nn.Parameter]:
        return [param for _, param in self.backend.named_trainable_parameters(key)]

    def gradients(self, key: str) -> list[torch.Tensor]:
        params = self._params(key)
        for param in params:
            if param.grad is None:  # an empty share: nothing accumulated, it adds zeros
                param.grad = torch.zeros_like(param)
        return [param.grad for param in params]

    def step(self, key: str, adam: AdamParams, grad_norm: float | None, *, core: bool) -> dict[str, float]:
        if not core:
            return self.backend.optim_step(key, adam)  # no core dist on a lane: it only clips and steps
        return self.backend.optim_step(key, adam, reduce=False)

    def drop_gradients(self, key: str) -> None:
        for param in self._params(key):
            param.grad = None

    def state_entries(self, key: str) -> Entries:
        return state.state_entries(self.backend, key)

    def broadcast_state(self, group: LaneGroup | None, key: str, root: int) -> None:
        if group is not None:
            state.broadcast_state(group, self.backend, key, root)


class MegatronReplica:
    shared_norm = True

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._named = list(backend.gpt.named_parameters())

    def core_dist(self) -> DistContext | None:
        dp = self.backend.data_parallel()
        return dp if dp.world_size > 1 else None

    def gradients(self, key: str) -> list[torch.Tensor]:
        return self.backend.gradient_buffers()

    def step(self, key: str, adam: AdamParams, grad_norm: float | None, *, core: bool) -> dict[str, float]:
        if grad_norm is None:
            raise ValueError("a megatron replica steps by the norm the lanes' rank 0 measured")
        return self.backend.step_summed(adam, grad_norm)

    def drop_gradients(self, key: str) -> None:
        self.backend.drop_gradients()

    def state_entries(self, key: str) -> Entries | None:
        whole = self.backend.whole_optimizer_state()  # every core rank gathers; rank 0 gets it
        if whole is None:
            return None
        entries: Entries = []
        for name, param_state in whole.items():
            entries += [(f"{name}::{field}", tensor) for field, tensor in param_state.tensors.items()]
            step = -1.0 if param_state.step is None else param_state.step
            entries.append((f"{name}::step", torch.tensor(step, dtype=torch.float64)))
        return entries

    def broadcast_state(self, group: LaneGroup | None, key: str, root: int) -> None:
        from miles.train.megatron import zero_state

        names = [name for name, _ in self._named]
        numels = [param.numel() for _, param in self._named]
        sends = group is None or group.rank == root
        whole = self.backend.whole_optimizer_state() if sends else None  # the core's ranks gather
        if group is None:
            return  # a core rank other than 0: its part was the gather
        stepped = torch.tensor([0], dtype=torch.int64)
        if whole is not None:
            stepped[0] = int(any(s.step is not None for s in whole.values()))
        group.broadcast(stepped, root)
        packed = torch.zeros(zero_state.packed_numel(numels, bool(stepped[0])))
        if whole is not None:
            packed = zero_state.pack_whole(whole, names)
        group.broadcast(packed, root)
        if group.rank != root:
            self.backend.load_whole_optimizer_state(
                zero_state.unpack_whole(packed, names, numels, bool(stepped[0]))
            )


def replica_for(backend: TrainBackend) -> Replica:
    from miles.train.backends.megatron_backend import MegatronBackend

    if isinstance(backend, MegatronBackend):
        return MegatronReplica(backend)
    return TransformersReplica(backend)
