"""A small in-memory InstanceBackend for the controller's pure logic (the Ray backend has its own tests),
a settable clock, and catalog entries."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from miles.catalog.api import AdoptingBackend, InstanceSpec
from miles.contract.catalog import CatalogModel, PoolNode


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class InstanceRuntime:
    """What an instance serves, reduced to what the controller calls: release_model (the reset)."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.released: list[str] = []
        self.fail_release = False

    async def release_model(self, model_id: str) -> None:
        await asyncio.sleep(0)
        if self.fail_release:
            raise RuntimeError("trainer did not answer Reset")
        self.released.append(model_id)


class MemoryBackend:
    """Starts 'instances' as InstanceRuntime objects; GPUs are only the controller's books here."""

    def __init__(self, nodes: list[PoolNode]) -> None:
        self.nodes = nodes
        self.started: list[InstanceSpec] = []
        self.stopped: list[str] = []
        self.live: dict[str, InstanceRuntime] = {}
        self.gate: asyncio.Event | None = None  # when set, starts wait for it
        self.fail_next_start: str | None = None
        self.fail_stop = False

    async def start(self, spec: InstanceSpec) -> Any:
        self.started.append(spec)
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next_start:
            cause, self.fail_next_start = self.fail_next_start, None
            raise RuntimeError(cause)
        runtime = InstanceRuntime(spec)
        self.live[spec.instance_id] = runtime
        return runtime

    async def stop(self, spec: InstanceSpec) -> None:
        await asyncio.sleep(0)
        if self.fail_stop:
            raise RuntimeError("placement group removal timed out")
        self.stopped.append(spec.instance_id)
        self.live.pop(spec.instance_id, None)

    async def alive(self, spec: InstanceSpec) -> bool:
        return spec.instance_id in self.live

    def pool_nodes(self) -> list[PoolNode]:
        return list(self.nodes)


class AdoptingMemoryBackend(MemoryBackend, AdoptingBackend):
    """The memory backend that takes over the instances a previous controller left alive."""

    def __init__(self, nodes: list[PoolNode]) -> None:
        super().__init__(nodes)
        self.adopted: dict[str, list[str]] = {}  # instance id -> the handles adopt() was given

    async def adopt(self, spec: InstanceSpec, model_ids: list[str]) -> Any:
        self.adopted[spec.instance_id] = list(model_ids)
        return self.live.get(spec.instance_id)


def catalog_model(name: str = "tiny-a", **changes: Any) -> CatalogModel:
    base = CatalogModel(
        name=name,
        path=None,
        train_modes=("lora", "full"),
        gpus_per_instance=2,
        engines_per_instance=1,
        lora_slots=2,
        max_lora_rank=32,
        max_context=512,
        resident=False,
        idle_timeout_s=60.0,
        max_lifetime_s=None,
        init="tiny",
    )
    return replace(base, **changes)
