"""Each catalog model's instances start with their own settings: its directory, its train mode, and for
SGLang engines the LoRA flags of that model (its max_lora_rank; none for a full-only model)."""

from __future__ import annotations

from pathlib import Path

from launcher.catalog_preset import effective_catalog
from launcher.presets import load_preset
from miles.runtime.catalog_bringup import catalog_recipes

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
