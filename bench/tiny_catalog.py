"""The tiny model's catalog on a local Ray, as a catalog job's bring-up builds it: `bench/catalog.py` times
it, and the catalog tests on Ray (tests/fast/runtime/) drive the same router, so both measure and check one
setup."""

from __future__ import annotations

from pathlib import Path

from miles.catalog.controller import CatalogController
from miles.contract.catalog import CatalogModel
from miles.engines.config import EngineConfig
from miles.runtime.catalog_runtime import CatalogRuntime
from miles.runtime.instances import RayInstanceBackend, catalog_recipe, recipe_table
from miles.runtime.model_cells import CellSettings
from miles.state import StateStore
from miles.train.coalescer import DEFAULT_WINDOW_S
from miles.weights.push import PushConfig


def tiny_catalog_model(
    name: str, mode: str, *, slots: int = 2, gpus: int = 2, idle_s: float = 600.0, resident: bool = False
) -> CatalogModel:
    return CatalogModel(
        name=name,
        path=None,
        train_modes=(mode,),
        gpus_per_instance=gpus,
        engines_per_instance=1,
        lora_slots=slots,
        max_lora_rank=8,
        max_context=512,
        resident=resident,
        idle_timeout_s=idle_s,
        max_lifetime_s=None,
        init="tiny",
    )


def build_router(
    models: list[CatalogModel],
    model_dir: Path,
    log_dir: Path,
    *,
    store: StateStore | None = None,
    namespace: str | None = None,
    lora_batch_window_s: float = DEFAULT_WINDOW_S,
) -> CatalogRuntime:
    """What a catalog job's bring-up builds; with `store` (Redis) and `namespace`, as when its books
    outlive the driver: named, detached instances."""
    base = CellSettings(
        model_dir=model_dir,
        train_mode="lora",
        engine=EngineConfig(model_path=str(model_dir), startup_timeout_s=120),
        trainer_dtype="float32",
        max_batch_tokens=8192,
        log_dir=log_dir,
    )
    recipes = {m.name: catalog_recipe(m, model_dir, base, tokenizer_id=str(model_dir)) for m in models}
    backend = RayInstanceBackend(
        recipe_table(recipes),
        push=PushConfig(backend="gloo"),
        lora_batch_window_s=lora_batch_window_s,
        placement_timeout_s=30,
        namespace=namespace,
    )
    controller = CatalogController(models, backend, store=store)
    cards = {name: recipe.card for name, recipe in recipes.items()}
    return CatalogRuntime(controller, backend, cards, reap_interval_s=1)
