"""Each catalog model's instances start with their own settings: its directory, its train mode, and for
SGLang engines the LoRA flags of that model (its max_lora_rank; none for a full-only model); and with the
preset's runtime settings (the batching window)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.presets import load_preset
from miles.catalog.api import InstanceSpec
from miles.contract.preset.catalog import effective_catalog
from miles.driver.catalog import catalog_recipes, instance_backend
from miles.runtime import instances
from miles.runtime.instances import RayInstanceBackend
from miles.runtime.ray_runtime import RayRuntime
from miles.state import MemoryStateStore
from miles.train.coalescer import DEFAULT_WINDOW_S

CATALOG = (
    "catalog=[{name: tiny-a, init: tiny, train_modes: [lora], max_lora_rank: 16},"
    " {name: tiny-f, init: tiny, train_modes: [full]}]"
)


def test_each_catalog_model_gets_its_own_engine_flags_train_mode_and_card(tmp_path: Path) -> None:
    preset = load_preset(
        "tiny-cpu",
        overrides=[CATALOG, "model.name=tiny-a", "engines.kind=sglang", "model.lora_rank=8"],
        env={},
    )
    recipes = catalog_recipes(preset, effective_catalog(preset), tmp_path)
    lora, full = recipes["tiny-a"], recipes["tiny-f"]
    assert "--max-lora-rank=16" in lora.settings.engine.extra_args  # the entry's rank, not model.lora_rank
    assert "--enable-lora" in lora.settings.engine.extra_args
    assert not any("lora" in flag for flag in full.settings.engine.extra_args)
    assert (lora.settings.train_mode, full.settings.train_mode) == ("lora", "full")
    assert (lora.card.train_mode, lora.card.max_lora_rank) == ("lora", 16)
    assert (full.card.train_mode, full.card.max_lora_rank) == ("full", None)
    assert lora.settings.model_dir == full.settings.model_dir == (tmp_path / "model").resolve()
    assert Path(lora.settings.engine.model_path) == lora.settings.model_dir


@pytest.mark.parametrize(("window_ms", "want_s"), [(12, 0.012), (0, 0.0), (None, DEFAULT_WINDOW_S)])
def test_catalog_instances_batch_with_the_presets_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_ms: float | None, want_s: float
) -> None:
    """A catalog instance's runtime merges tenants' passes with the preset's runtime.lora_batch_window_ms
    (0: every request alone), as the resident model's does, not the coalescer's default. The instance
    starts through RayInstanceBackend.start and the real serve_model_cells and RayRuntime; only the Ray
    placement, the cells and the first weight push are replaced."""
    overrides = [CATALOG, "model.name=tiny-a"]
    if window_ms is not None:
        overrides.append(f"runtime.lora_batch_window_ms={window_ms}")
    preset = load_preset("tiny-cpu", overrides=overrides, env={})
    models = effective_catalog(preset)
    backend = instance_backend(preset, catalog_recipes(preset, models, tmp_path), MemoryStateStore())
    assert backend.lora_batch_window_s == pytest.approx(want_s)

    async def nothing(*args: object, **kwargs: object) -> None:
        return None

    async def fake_cells(*args: object, **kwargs: object) -> SimpleNamespace:
        inference = SimpleNamespace(set_weight_refresher=lambda _: None, start_health_checks=lambda: None)
        return SimpleNamespace(trainer=object(), inference=inference)

    monkeypatch.setattr(instances, "create_single_node_placement_group", nothing)
    monkeypatch.setattr(instances, "start_model_cells", fake_cells)
    monkeypatch.setattr(RayInstanceBackend, "_layout", nothing)
    monkeypatch.setattr(RayRuntime, "publish_initial_weights", nothing)
    lora = next(model for model in models if model.name == "tiny-a")
    spec = InstanceSpec(lora, "tiny-a#1", 1, "127.0.0.1", lora.gpus_per_instance, train_mode="lora")
    runtime = asyncio.run(backend.start(spec))
    assert isinstance(runtime, RayRuntime)
    assert runtime.coalescer.window_s == pytest.approx(want_s)
