"""The protocol every trainer backend implements (transformers, megatron), and the optional ones after it.

A backend owns one base model on one device and is called by one data-parallel rank, through the command
objects of miles.train.commands (each calls one method below). Model keys name what
trains: a LoRA backend holds several named adapters on one frozen base; a full backend has exactly one
trainable model and accepts any key for it (see TransformersBackend).

What only some backends can do is a protocol of its own below, which a backend declares by inheriting it;
callers test `isinstance` and take the plain path for a backend without it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec

if TYPE_CHECKING:  # the commands that name these protocols travel without importing torch
    import torch

    from miles.errors import UserError
    from miles.train.commands import ForwardBackward, OptimStep
    from miles.train.dist import DistContext
    from miles.utils.buckets import TensorMeta


@runtime_checkable
class TrainBackend(Protocol):
    train_mode: str  # "lora" | "full"

    def create_adapter(self, key: str, spec: LoraSpec) -> None: ...

    def remove_adapter(self, key: str) -> None: ...

    def has_adapter(self, key: str) -> bool: ...

    def model_keys(self) -> list[str]: ...

    def forward_backward(
        self,
        key: str,
        data: Sequence[Datum],
        loss_fn: str,
        loss_config: Mapping[str, float],
        forward_only: bool = False,
    ) -> ForwardBackwardOutput: ...

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]: ...

    def save_state(self, key: str, path: Path, *, with_optimizer: bool) -> None: ...

    def load_state(self, key: str, path: Path, *, with_optimizer: bool) -> None: ...

    def export_adapter(self, key: str, path: Path) -> None: ...

    def export_hf_weights(self, path: Path) -> None: ...

    def export_merged_hf_weights(self, key: str, path: Path) -> None: ...

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def reset(self, key: str) -> None: ...


# ---- optional capabilities ------------------------------------------------------------------------


@runtime_checkable
class MergesForwardBackward(Protocol):
    """Several models' forward_backward requests (one per model) in one pass over the shared base; one
    outcome each: its output, or the UserError that failed it alone (miles.train.coalescer)."""

    def forward_backward_many(
        self, requests: Sequence[ForwardBackward]
    ) -> list[ForwardBackwardOutput | UserError]: ...


@runtime_checkable
class MergesOptimSteps(Protocol):
    """Several models' optim_steps queued back to back with one wait for the device; one outcome each."""

    def optim_step_many(self, requests: Sequence[OptimStep]) -> list[dict[str, float] | UserError]: ...


@runtime_checkable
class DataParallel(Protocol):
    """A backend whose rank is one of several data-parallel ranks: `dist` is their group (None: alone)."""

    dist: DistContext | None


# sender: joins the engines' group and broadcasts each bucket; gatherer: sends the sender its shards of each
# bucket; idle: holds copies the push does not need (another data-parallel replica)
PushRole = Literal["sender", "gatherer", "idle"]


class PushSource(Protocol):
    """One rank's part in a weight push of weights held in shards over ranks (miles/train/megatron/push.py,
    pipeline_weights.py): the sender gathers each bucket from the gatherers and broadcasts it."""

    role: PushRole

    def metas(self) -> list[TensorMeta]: ...

    def gather_bucket(self, names: Sequence[str]) -> list[torch.Tensor] | None: ...


@runtime_checkable
class ShardedWeights(Protocol):
    """Weights that do not lie whole on rank 0: the weight push (miles.weights.sender) gathers them bucket
    by bucket through the push source instead of walking iter_hf_weights."""

    def push_source(self) -> PushSource: ...


@runtime_checkable
class PushLayoutKeyed(Protocol):
    """A cheap token that changes whenever iter_hf_weights would yield other memory: the weight push reuses
    its walk of the weights while it holds. None: walk every time."""

    def push_layout_key(self) -> Hashable | None: ...


@runtime_checkable
class StagesHfWeights(Protocol):
    """export_hf_weights in two halves, so a named sampler snapshot is written behind (write_behind.py):
    `stage_hf_weights` copies the full model to host memory now (every rank joins what it must), and the
    writer it returns writes that copy as export_hf_weights would, later, in another thread. None: this rank
    writes nothing."""

    def stage_hf_weights(self) -> Callable[[Path], None] | None: ...


@runtime_checkable
class OffloadsTrainState(Protocol):
    """Moves its optimizer state and gradients off the GPU while colocated engines sample, and back before
    training (miles/train/backends/offload.py). A backend without it keeps everything resident."""

    def offload_train_state(self, what: Sequence[str]) -> dict[str, int]: ...

    def reload_train_state(self) -> int: ...
