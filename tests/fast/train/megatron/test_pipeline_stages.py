"""Which pipeline stage holds which megatron tensor, under which name and shape (pure; no megatron needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles.contract.shape import ModelShape
from miles.train.megatron.stages import local_name, mcore_shape, owning_stage, stage_layers, stage_rules
from miles.train.megatron.weights import fuse, tensor_rules


@pytest.fixture(scope="module")
def four_layers(tiny_model_dir: Path) -> ModelShape:
    return dataclasses.replace(ModelShape.from_model_dir(tiny_model_dir), num_layers=4)


def test_stages_take_consecutive_equal_shares_of_the_layers() -> None:
    assert [stage_layers(8, 4, s) for s in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


@pytest.mark.parametrize("pipeline", [1, 2, 4])
def test_every_tensor_lies_on_exactly_one_stage_under_that_stages_own_layer_numbers(
    four_layers: ModelShape, pipeline: int
) -> None:
    whole = tensor_rules(four_layers)
    per_stage = [stage_rules(four_layers, pipeline, s) for s in range(pipeline)]
    for rule in whole:
        stage = owning_stage(rule.mcore_name, four_layers, pipeline)
        first = stage_layers(four_layers.num_layers, pipeline, stage).start
        assert dataclasses.replace(rule, mcore_name=local_name(rule.mcore_name, first)) in per_stage[stage]
    assert sum(len(rules) for rules in per_stage) == len(whole)  # untied: no stage holds a copy
    layer_names = {r.mcore_name.split(".")[2] for r in per_stage[-1] if r.mcore_name.startswith("decoder.l")}
    assert layer_names == {str(i) for i in range(four_layers.num_layers // pipeline)}
    assert per_stage[0][0].mcore_name == "embedding.word_embeddings.weight"
    assert per_stage[-1][-1].mcore_name == "output_layer.weight"


def test_a_tied_models_last_stage_loads_its_output_layer_from_the_embedding(four_layers: ModelShape) -> None:
    tied = dataclasses.replace(four_layers, tie_embeddings=True)
    last = stage_rules(tied, 2, 1)
    assert last[-1].mcore_name == "output_layer.weight"
    assert last[-1].hf_names == ("model.embed_tokens.weight",)
    assert not any(r.mcore_name == "output_layer.weight" for r in stage_rules(tied, 1, 0))


def test_the_whole_shapes_from_the_model_shape_are_those_of_the_fused_checkpoint_tensors(
    tiny_model_dir: Path,
) -> None:
    shape = ModelShape.from_model_dir(tiny_model_dir)
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    for rule in tensor_rules(shape):
        assert mcore_shape(rule, shape) == tuple(fuse(rule, hf, shape).shape), rule.mcore_name
