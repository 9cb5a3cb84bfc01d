"""The preset's `elastic:` section: defaults, validation, and the reserve that could never lend."""

from __future__ import annotations

import pytest

from miles.contract.preset import PresetError, lora_batch_window_ms
from miles.contract.preset.files import validate_preset
from miles.contract.preset.runtime import ElasticOptions


def preset(gpus_per_node: int = 1, **elastic) -> dict:
    return {
        "name": "elastic-test",
        "nodes": 3,
        "train_nodes": 1,
        "gpus_per_node": gpus_per_node,
        "model": {"name": "m", "init": "tiny"},
        "engines": {"kind": "cpu"},
        "elastic": elastic,
    }


def test_defaults_are_off_and_the_section_reads_as_given() -> None:
    resolved = validate_preset(preset())
    assert resolved.elastic == ElasticOptions() and resolved.elastic.enabled is False
    on = validate_preset(
        preset(enabled=True, min_rollout_gpus=1, idle_window_s=5, max_hybrid_lanes=2, min_loan_s=0)
    )
    assert on.elastic == ElasticOptions(
        enabled=True, min_rollout_gpus=1, idle_window_s=5.0, max_hybrid_lanes=2, min_loan_s=0.0
    )


@pytest.mark.parametrize(
    ("elastic", "message"),
    [
        ({"min_rollout_gpus": -1}, "elastic.min_rollout_gpus"),
        ({"idle_window_s": -2.0}, "elastic.idle_window_s"),
        ({"max_hybrid_lanes": 0}, "elastic.max_hybrid_lanes"),
        ({"min_loan_s": -1}, "elastic.min_loan_s"),
        ({"min_loan_s": "60"}, "elastic.min_loan_s"),
        ({"enabled": "yes"}, "elastic.enabled"),
        ({"lanes": 2}, "elastic.lanes"),
        ({"enabled": True, "min_rollout_gpus": 2}, "keeps all 2 engine GPUs serving"),
    ],
)
def test_bad_elastic_settings_are_refused_naming_the_key(elastic: dict, message: str) -> None:
    with pytest.raises(PresetError, match=message):
        validate_preset(preset(**elastic))


@pytest.mark.parametrize(
    "layout", [{"gpus_per_node": 4}, {"nodes": 1, "gpus_per_node": 3, "engines": {"kind": "cpu"}}]
)
def test_a_trainer_of_several_ranks_and_a_megatron_full_trainer_are_accepted(layout: dict) -> None:
    """A core of several ranks joins the lanes through its rank 0; a megatron core of full fine-tuning at
    TP, PP and CP 1 lends to DP 1 replicas of itself (docs/elastic.md). Other megatron trainers are refused
    at submit, saying how to fix it, and are fine without elastic."""
    raw = {**preset(enabled=True), **layout}
    assert validate_preset(raw).elastic.enabled
    full = {**raw["model"], "backend": "megatron", "train_mode": "full"}
    assert validate_preset({**raw, "model": full}).model.backend == "megatron"
    refused = [
        (
            {**full, "train_mode": "lora"},
            r"megatron lends engines to full fine-tuning only.*model.train_mode full",
        ),
        ({**full, "parallel": {"tensor": 2}}, r"tensor, pipeline and context 1 \(got tensor 2, pipeline 1"),
        ({**full, "parallel": {"pipeline": 2}}, r"got tensor 1, pipeline 2, context 1"),
    ]
    for model, message in refused:
        with pytest.raises(PresetError, match=message):
            validate_preset({**raw, "model": model})
        validate_preset({**raw, "model": model, "elastic": {"enabled": False}})  # fine without elastic


def test_merged_lora_passes_are_refused_with_elastic() -> None:
    """An explicit window is refused; without one, an elastic job runs with 0 (batching off) while the same
    job without elastic gets the default window."""
    raw = {**preset(enabled=True), "runtime": {"lora_batch_window_ms": 5}}
    with pytest.raises(PresetError, match=r"lora_batch_window_ms > 0 .* set it to 0"):
        validate_preset(raw)
    assert lora_batch_window_ms(validate_preset(preset(enabled=True))) == 0.0
    assert lora_batch_window_ms(validate_preset(preset(enabled=False))) > 0
