"""The model catalog's seam: what the controller needs from whatever starts instances (Ray placement
groups in production), and what callers (the routing runtime, the gateway via `Runtime.catalog()`) get.

Pure types: no Ray, no I/O. `miles.catalog.controller.CatalogController` is the one implementation of
`CatalogApi`; `InstanceBackend` implementations live with the Ray runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles.contract.catalog import CatalogModel, PoolNode, TrainMode

if TYPE_CHECKING:
    from miles.seam.runtime import Runtime


@dataclass(frozen=True)
class InstanceSpec:
    model: CatalogModel  # the catalog entry
    instance_id: str  # unique, e.g. "tiny-a#3" (model name made safe, then the epoch)
    epoch: int  # new for every start
    node: str  # the pool node (Ray node IP) the instance must be packed on
    gpus: int  # == model.gpus_per_instance
    # The mode its trainer is loaded for: an instance serves tenants of that mode only (a model allowing
    # both gets instances of either kind); None only in books written before the field existed.
    train_mode: TrainMode | None = None


class InstanceBackend(Protocol):
    """Starts and stops instances; the controller calls it, never anything else."""

    async def start(self, spec: InstanceSpec) -> Runtime: ...  # a Runtime serving that model

    async def stop(self, spec: InstanceSpec) -> None: ...  # idempotent; frees its GPUs (PG removed)

    async def alive(self, spec: InstanceSpec) -> bool: ...  # actors still there (for recovery/health)

    def pool_nodes(self) -> list[PoolNode]: ...  # nodes and GPU counts the pool may use


@runtime_checkable
class AdoptingBackend(Protocol):
    """An InstanceBackend that can take over instances a previous controller started: after a restart, a
    Runtime for an instance whose actors are still alive, told the handles (model ids) its tenants hold,
    or None. A backend without it has its live instances stopped on recovery."""

    async def adopt(self, spec: InstanceSpec, model_ids: list[str]) -> Runtime | None: ...


@dataclass(frozen=True)
class Acquired:
    """What `acquire` hands back: route the handle's operations to `runtime`, admitted under `epoch`."""

    runtime: Runtime
    epoch: int
    instance_id: str
    resident: bool  # the instance is resident (previous tenants' state was reset when they left)


class CatalogApi(Protocol):
    """The controller's public API (miles.catalog.controller.CatalogController).

    Call order for a handle (`model_id` is the tinker model id):
      acquire(...) when the handle is created (create_model) -> route create_model to `Acquired.runtime`;
      check_epoch(model_id, epoch) + touch(model_id) before each training/sampling op on the handle;
      quarantine(instance_id, cause) when an op on the instance exceeded its execution timeout;
      release(model_id) on release_model (unload, session end): it resets the slot or stops the instance;
      expire_idle() and check_health() from periodic tasks; snapshot() for Runtime.catalog().
    """

    def models(self) -> list[CatalogModel]: ...

    async def start_residents(self) -> None: ...

    async def acquire(
        self, model_id: str, base_model: str, train_mode: str, lora: Any | None
    ) -> Acquired: ...

    def touch(self, model_id: str) -> None: ...

    def check_epoch(self, model_id: str, epoch: int) -> Runtime: ...

    def handle_runtime(self, model_id: str) -> tuple[Runtime, int]: ...

    async def release(self, model_id: str) -> None: ...

    async def quarantine(self, instance_id: str, cause: str) -> None: ...

    async def expire_idle(self) -> list[str]: ...

    async def check_health(self) -> list[str]: ...

    def health_problem(self) -> str | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    async def recover(self) -> None: ...  # before start_residents, with the controller's StateStore

    async def close(self) -> None: ...
