"""The preset's `elastic:` section: defaults, validation, and the reserve that could never lend."""

from __future__ import annotations

import pytest

from launcher.presets import PresetError, validate_preset
from miles.elastic.policy import ElasticSettings


def preset(**elastic) -> dict:
    return {
        "name": "elastic-test",
        "nodes": 3,
        "train_nodes": 1,
        "gpus_per_node": 4,
        "model": {"name": "m", "init": "tiny"},
        "engines": {"kind": "cpu"},
        "elastic": elastic,
    }


def test_defaults_are_off_and_map_onto_the_controller_settings() -> None:
    resolved = validate_preset(preset())
    assert resolved.elastic.enabled is False
    on = validate_preset(preset(enabled=True, min_rollout_gpus=4, idle_window_s=5, max_hybrid_lanes=2))
    settings = ElasticSettings(**on.elastic.model_dump())
    assert settings == ElasticSettings(True, 4, 5.0, 2)


@pytest.mark.parametrize(
    ("elastic", "message"),
    [
        ({"min_rollout_gpus": -1}, "elastic.min_rollout_gpus"),
        ({"idle_window_s": -2.0}, "elastic.idle_window_s"),
        ({"max_hybrid_lanes": 0}, "elastic.max_hybrid_lanes"),
        ({"enabled": "yes"}, "elastic.enabled"),
        ({"lanes": 2}, "elastic.lanes"),
        ({"enabled": True, "min_rollout_gpus": 8}, "keeps all 8 engine GPUs serving"),
    ],
)
def test_bad_elastic_settings_are_refused_naming_the_key(elastic: dict, message: str) -> None:
    with pytest.raises(PresetError, match=message):
        validate_preset(preset(**elastic))
