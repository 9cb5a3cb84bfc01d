"""The catalog's Prometheus metrics follow the controller's books and events."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from miles.catalog.controller import CatalogController
from miles.catalog.errors import CapacityError, HandleExpired
from miles.contract.catalog import PoolNode
from miles.observability.catalog_metrics import CatalogMetrics
from miles.types import LoraSpec
from tests.fast.catalog.memory_backend import MemoryBackend, catalog_model


async def test_gauges_and_counters_follow_starts_rejections_expiries_and_releases(clock) -> None:
    registry = CollectorRegistry()
    backend = MemoryBackend([PoolNode("10.0.0.1", 2)])
    ctl = CatalogController(
        [catalog_model(lora_slots=1)], backend, clock=clock, metrics=CatalogMetrics(registry)
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    await ctl.acquire("m", "tiny-a", "lora", LoraSpec(rank=4))
    assert value("miles_catalog_instances", model="tiny-a", state="ready") == 1
    assert value("miles_catalog_handles", model="tiny-a") == 1 and value("miles_catalog_free_gpus") == 0
    with pytest.raises(CapacityError):
        await ctl.acquire("n", "tiny-a", "lora", LoraSpec(rank=4))
    assert value("miles_catalog_capacity_rejections_total", model="tiny-a") == 1
    clock.now += 61
    await ctl.expire_idle()
    assert value("miles_catalog_handle_expiries_total", model="tiny-a") == 1
    assert value("miles_catalog_instance_starts_total", model="tiny-a") == 1
    assert value("miles_catalog_instance_releases_total", model="tiny-a") == 1
    assert value("miles_catalog_instances", model="tiny-a", state="ready") == 0
    assert value("miles_catalog_handles", model="tiny-a") == 0 and value("miles_catalog_free_gpus") == 2


def test_every_catalog_metric_is_in_the_docs_table() -> None:
    registry = CollectorRegistry()
    CatalogMetrics(registry)
    exported = {f"{f.name}_total" if f.type == "counter" else f.name for f in registry.collect()}
    doc = (Path(__file__).resolve().parents[3] / "docs" / "catalog.md").read_text()
    documented = set(re.findall(r"^\| `(miles_catalog_[a-z_]+)` \|", doc, flags=re.M))
    assert len(exported) == 7 and exported == documented


async def test_lifetime_expiries_are_counted_whether_an_operation_or_the_sweep_finds_them(clock) -> None:
    registry = CollectorRegistry()
    ctl = CatalogController(
        [catalog_model(max_lifetime_s=100.0)],
        MemoryBackend([PoolNode("10.0.0.1", 2)]),
        clock=clock,
        metrics=CatalogMetrics(registry),
    )
    for model_id in ("lazy", "swept"):
        await ctl.acquire(model_id, "tiny-a", "lora", LoraSpec(rank=4))
    clock.now += 50
    ctl.touch("lazy")
    ctl.touch("swept")
    clock.now += 50  # 100 s old, 50 s idle
    with pytest.raises(HandleExpired):
        ctl.touch("lazy")
    await asyncio.sleep(0.01)
    assert await ctl.expire_idle() == ["swept"]
    assert registry.get_sample_value("miles_catalog_handle_expiries_total", {"model": "tiny-a"}) == 2
