"""The catalog's model as both halves see it: one trainable model (a preset's `catalog:` entry, or its
single `model:`), a node of the device pool, and whether a set of instances fits the pool (the launcher
checks that at submit; the catalog controller books it in the job)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TrainMode = Literal["lora", "full"]
TRAIN_MODES: tuple[TrainMode, ...] = ("lora", "full")


@dataclass(frozen=True)
class CatalogModel:
    """One trainable model of the catalog (a preset's `catalog:` entry, or its single `model:`)."""

    name: str  # the tinker base_model clients ask for
    path: str | None  # HF directory or hub name; None with init "tiny"
    train_modes: tuple[TrainMode, ...]  # non-empty subset of TRAIN_MODES
    gpus_per_instance: int  # all on one node (one STRICT_PACK placement group)
    engines_per_instance: int
    lora_slots: int  # LoRA tenants one instance holds at once
    max_lora_rank: int
    max_context: int
    resident: bool  # started at bring-up, never released; reset before each new tenant
    idle_timeout_s: float  # business inactivity (no train/sample op) after which a handle expires
    max_lifetime_s: float | None  # a handle's hard age limit; None: none
    init: Literal["pretrained", "tiny"] = "pretrained"
    backend: Literal["transformers", "megatron"] = "transformers"
    init_shape: str = "tiny"  # with init "tiny": the shape built (miles.contract.preset.model.InitShape)

    def allows(self, train_mode: str) -> bool:
        return train_mode in self.train_modes


@dataclass(frozen=True)
class PoolNode:
    """A node of the device pool: its Ray node IP and the GPUs (bundles) the catalog may use on it."""

    node: str  # Ray node IP
    gpus: int
    is_head: bool = False  # the head is used last, as in today's placement


def fits(capacities: list[int], demands: list[int]) -> bool:
    """Whether instances of `demands` GPUs each pack onto nodes of `capacities` (first fit, largest first)."""
    free = list(capacities)
    for gpus in sorted(demands, reverse=True):
        slot = next((i for i, f in enumerate(free) if f >= gpus), None)
        if slot is None:
            return False
        free[slot] -= gpus
    return True
