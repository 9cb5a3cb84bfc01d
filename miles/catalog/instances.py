"""Instance records and tenancy: which instance a new tenant goes to. Pure functions over records."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from miles.catalog.api import InstanceSpec
from miles.catalog.states import ACCEPTS_TENANTS, InstanceState, check_transition
from miles.contract.catalog import CatalogModel
from miles.seam.runtime import Runtime

RESET_PREFIX = "~reset:"  # a slot held while a departed tenant's state is being reset


def instance_id_for(model_name: str, epoch: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model_name)}#{epoch}"


@dataclass
class Instance:
    spec: InstanceSpec
    resident: bool  # never released while healthy; reset before each new tenant
    state: InstanceState = InstanceState.STARTING
    tenants: dict[str, str] = field(default_factory=dict)  # model_id (or a reset hold) -> train mode
    started_at: float = 0.0
    last_active_at: float = 0.0  # the last business activity of any tenant (or the last departure)
    cause: str | None = None  # why it was quarantined or failed
    runtime: Runtime | None = None
    stopping: bool = False  # a backend stop is in flight (one at a time)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def model(self) -> CatalogModel:
        return self.spec.model

    def move(self, target: InstanceState) -> None:
        check_transition(self.instance_id, self.state, target)
        self.state = target

    def has_full_tenant(self) -> bool:
        return "full" in self.tenants.values()

    def to_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "model": self.model.name,
            "model_entry": {**asdict(self.model), "train_modes": list(self.model.train_modes)},
            "epoch": self.spec.epoch,
            "node": self.spec.node,
            "gpus": self.spec.gpus,
            "train_mode": self.spec.train_mode,
            "resident": self.resident,
            "state": self.state.value,
            "tenants": {k: v for k, v in self.tenants.items() if not k.startswith(RESET_PREFIX)},
            "started_at": self.started_at,
            "cause": self.cause,
        }


def default_mode(model: CatalogModel) -> str:
    """The mode a resident instance starts in: LoRA when the model allows it (tenants share it), else full."""
    return "lora" if model.allows("lora") else "full"


def resident_mode(instance: Instance) -> str:
    """The mode a restarted resident comes back in: the one it had."""
    return instance.spec.train_mode or default_mode(instance.model)


def has_room(instance: Instance, train_mode: str) -> bool:
    """Whether a new tenant of `train_mode` may join `instance` now."""
    if instance.state not in ACCEPTS_TENANTS:
        return False
    if instance.spec.train_mode not in (None, train_mode):
        return False  # its trainer is loaded for the other mode
    if train_mode == "full":
        return not instance.tenants  # a full tenant owns its instance alone
    return not instance.has_full_tenant() and len(instance.tenants) < instance.model.lora_slots


def choose_instance(instances: list[Instance], model_name: str, train_mode: str) -> Instance | None:
    """The instance of `model_name` a new tenant joins, or None (a new instance is needed).

    LoRA tenants pack onto the fullest instance with a free slot, leaving the others to empty and be
    released; ties go to the oldest (lowest epoch)."""
    candidates = [i for i in instances if i.model.name == model_name and has_room(i, train_mode)]
    if not candidates:
        return None
    return min(candidates, key=lambda i: (-len(i.tenants), i.spec.epoch))
