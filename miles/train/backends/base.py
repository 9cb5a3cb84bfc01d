"""The protocol every trainer backend implements (transformers today; Megatron later).

A backend owns one base model on one device and is called by one data-parallel rank, through the command
objects of miles.train.commands (each calls one method below). Model keys name what
trains: a LoRA backend holds several named adapters on one frozen base; a full backend has exactly one
trainable model and accepts any key for it (see TransformersBackend).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec

if TYPE_CHECKING:  # the commands that name this protocol travel without importing torch
    import torch


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
