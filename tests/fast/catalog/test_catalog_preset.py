"""`catalog:` in a preset: each problem is named with its fix; every preset has an effective catalog."""

from __future__ import annotations

from typing import Any

import pytest

from launcher.presets import load_preset
from miles.contract.preset import PresetError
from miles.contract.preset.catalog import effective_catalog
from miles.contract.preset.files import validate_preset


def preset_with(catalog: list[dict[str, Any]] | None, **top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "cat",
        "nodes": 2,
        "gpus_per_node": 4,
        "model": {"name": "tiny-a", "init": "tiny"},
        "engines": {"kind": "cpu"},
        **top,
    }
    if catalog is not None:
        data["catalog"] = catalog
    return data


def entry(name: str = "tiny-a", **fields: Any) -> dict[str, Any]:
    return {"name": name, "init": "tiny", **fields}


def test_a_two_model_catalog_resolves_with_job_defaults() -> None:
    preset = validate_preset(
        preset_with(
            [entry(train_modes=["lora", "full"], resident=True), entry("tiny-b", idle_timeout_s=30.0)],
            catalog_defaults={"idle_timeout_s": 600.0, "max_lifetime_s": 7200.0},
        )
    )
    a, b = effective_catalog(preset)
    assert (a.name, a.train_modes, a.resident, a.idle_timeout_s) == ("tiny-a", ("lora", "full"), True, 600.0)
    assert (b.name, b.train_modes, b.idle_timeout_s, b.max_lifetime_s) == ("tiny-b", ("lora",), 30.0, 7200.0)


@pytest.mark.parametrize("name", ["tiny-cpu", "qwen3-4b-lora", "qwen3.8-27b-128k"])
def test_a_preset_without_catalog_is_a_catalog_of_one_resident_model(name: str) -> None:
    preset = load_preset(name)
    (only,) = effective_catalog(preset)
    assert only.name == preset.model.name and only.resident
    assert only.train_modes == (preset.model.train_mode,)


@pytest.mark.parametrize(
    ("catalog", "top", "expected"),
    [
        ([entry(), entry()], {}, "model name 'tiny-a' appears 2 times"),
        ([entry(train_modes=[])], {}, "catalog[0] (tiny-a).train_modes: list at least one of lora, full"),
        ([entry(train_modes=["qlora"])], {}, "catalog.0.train_modes.0"),
        ([entry(lora_slots=0)], {}, "catalog.0.lora_slots"),
        ([entry(gpus_per_instance=0)], {}, "catalog.0.gpus_per_instance"),
        ([entry(gpus_per_instance=8)], {}, "gpus_per_instance: 8 does not fit one node (gpus_per_node 4)"),
        ([entry("other")], {}, "model.name: 'tiny-a' must be one of catalog's names (other)"),
        ([entry(init="pretrained")], {}, "catalog[0] (tiny-a).path: required when init is 'pretrained'"),
        ([], {}, "catalog: list at least one model"),
        ([entry(gpus_per_instance=3, resident=True), entry("b", gpus_per_instance=3, resident=True),
          entry("c", gpus_per_instance=2, resident=True)], {}, "resident instances need 3+3+2 GPUs"),
        ([entry()], {"gpus_per_node": 0}, "gpus_per_node: a catalog needs at least 1 GPU per node"),
    ],
)  # fmt: skip
def test_bad_catalogs_are_refused_naming_the_fix(
    catalog: list[dict[str, Any]], top: dict[str, Any], expected: str
) -> None:
    with pytest.raises(PresetError) as refused:
        validate_preset(preset_with(catalog, **top))
    assert expected in str(refused.value)


def test_residents_that_pack_one_per_node_are_accepted() -> None:
    catalog = [entry(gpus_per_instance=3, resident=True), entry("b", gpus_per_instance=4, resident=True)]
    assert len(effective_catalog(validate_preset(preset_with(catalog)))) == 2
