"""Bring-up of a job whose preset has `catalog:`: no placement group at start; the catalog controller,
its Ray instance backend and the CatalogRuntime router; resident models' instances; then the gateway.

A preset without `catalog:` keeps today's path (`miles.driver.bringup.bring_up`: one group over every
node, the trainer on the plan's trainer nodes, engines on the others), which a single-node instance
could not reproduce for multi-node presets.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from miles.catalog.controller import CatalogController
from miles.contract.catalog import CatalogModel
from miles.contract.model_source import ModelNotFound, resolve_model_path
from miles.contract.preset import Preset, lora_batch_window_ms, state_key_prefix
from miles.contract.preset.catalog import effective_catalog
from miles.observability.catalog_metrics import CatalogMetrics
from miles.observability.metrics import job_metrics
from miles.runtime.catalog_runtime import CatalogRuntime
from miles.runtime.instances import InstanceRecipe, RayInstanceBackend, catalog_recipe, recipe_table
from miles.state import MemoryStateStore, StateStore, open_state_store


def catalog_model_dir(model: CatalogModel, run_dir: Path) -> tuple[Path, str]:
    """(directory, tokenizer id) of a catalog model: the tiny model built into the run dir (shared by
    every tiny entry), else its path resolved as the resident model's is (local directory or HF cache)."""
    if model.init == "tiny":
        from miles.models.tiny import build_tiny_model, tiny_spec

        # one directory per shape: entries of one shape share it, another shape is another model
        target = run_dir / ("model" if model.init_shape == "tiny" else f"model-{model.init_shape}")
        if not (target / "config.json").is_file():
            build_tiny_model(target, tiny_spec(model.init_shape))
        return target.resolve(), str(target.resolve())
    if not model.path:
        raise SystemExit(f"catalog model {model.name!r}: path is required unless init is 'tiny'")
    try:
        resolved = resolve_model_path(model.path)
    except ModelNotFound as exc:
        raise ModelNotFound(f"catalog model {model.name!r} on the head node: {exc}") from None
    return resolved.directory, resolved.hub_name or model.name


def catalog_recipes(preset: Preset, models: list[CatalogModel], run_dir: Path) -> dict[str, InstanceRecipe]:
    """Each model's recipe: the preset's cell settings for its directory, its train mode and LoRA rank."""
    from miles.driver.bringup import cell_settings

    recipes = {}
    for model in models:
        model_dir, tokenizer_id = catalog_model_dir(model, run_dir)
        mode = "lora" if model.allows("lora") else "full"
        settings = cell_settings(preset, model_dir, run_dir, (mode, model.max_lora_rank))
        recipes[model.name] = catalog_recipe(model, model_dir, settings, tokenizer_id)
    return recipes


def instance_namespace(preset: Preset, store: StateStore) -> str | None:
    """The Ray namespace a restarted driver finds this job's instances in, when its books outlive the
    driver (a Redis store); None with the memory store: nothing could be recovered, so instances die with
    the driver that started them instead of being detached."""
    if isinstance(store, MemoryStateStore):
        return None
    return f"{state_key_prefix(preset)}-catalog"


def instance_backend(
    preset: Preset, recipes: dict[str, InstanceRecipe], store: StateStore
) -> RayInstanceBackend:
    """The Ray backend of the catalog's instances, with the preset's runtime settings (the same batching
    window, adapter slots and push as the job's resident model would get)."""
    from miles.driver.bringup import push_config

    return RayInstanceBackend(
        recipe_table(recipes),
        push=push_config(preset),
        lora_batch_window_s=lora_batch_window_ms(preset) / 1000,
        max_loaded_adapters=preset.runtime.max_loaded_adapters,
        placement_timeout_s=preset.runtime.placement_timeout_s,
        namespace=instance_namespace(preset, store),
    )


async def bring_up_catalog(
    preset: Preset, run_dir: Path, timeline, stack: contextlib.AsyncExitStack
) -> CatalogRuntime:
    """Ray is connected; returns the CatalogRuntime the gateway serves (resident instances up)."""
    from miles.driver.bringup import start_gateway

    models = effective_catalog(preset)
    recipes = await asyncio.to_thread(catalog_recipes, preset, models, run_dir)
    store = open_state_store(preset.runtime.state_url, key_prefix=state_key_prefix(preset))
    backend = instance_backend(preset, recipes, store)
    stack.push_async_callback(store.close)
    controller = CatalogController(
        models, backend, store=store, metrics=CatalogMetrics(job_metrics().registry)
    )
    router = CatalogRuntime(controller, backend, {name: r.card for name, r in recipes.items()})
    stack.push_async_callback(router.close)  # stops every instance, residents included
    residents = [m.name for m in models if m.resident]
    pool = ", ".join(f"{n.node}: {n.gpus} GPUs" for n in backend.pool_nodes())
    timeline.phase("catalog", f"{len(models)} model(s); resident: {residents or 'none'}; pool {pool}")
    await controller.recover()  # a restarted driver: re-adopt live instances, release the rest
    await router.start()
    timeline.phase("gateway")
    await start_gateway(preset, run_dir, router, stack, store=store)
    return router
