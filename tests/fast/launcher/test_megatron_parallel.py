"""model.parallel (model.backend: megatron): sizes against the trainer GPUs when the preset loads, and
against the model's config.json at submit. Every refusal names the key and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from launcher.presets import load_preset
from launcher.submit_checks import submit_problems
from miles.contract.layout import gpu_problems, model_problems
from miles.contract.preset import PresetError
from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape

BIG = "qwen3.8-27b-128k"  # 5 trainer nodes x 8 GPUs


def big_with(*overrides: str):
    return load_preset(BIG, overrides=list(overrides), env={})


def refusal(*overrides: str) -> str:
    with pytest.raises(PresetError) as caught:
        big_with(*overrides)
    return str(caught.value)


def test_the_27b_preset_runs_tp8_with_sequence_parallel_and_full_recompute() -> None:
    parallel = big_with().model.parallel
    assert (parallel.tensor, parallel.pipeline, parallel.context, parallel.data) == (8, 1, 1, None)
    assert (parallel.sequence_parallel, parallel.recompute) == (True, "full")
    assert parallel.data_size(40) == 5


def test_sizes_that_do_not_divide_the_trainer_gpus_are_refused_with_the_sizes_that_do() -> None:
    message = refusal("model.parallel.tensor=3")
    assert "tensor 3 x pipeline 1 x context 1 = 3 does not divide the 40 trainer GPUs" in message
    assert "[1, 2, 4, 5, 8, 10, 20, 40]" in message


def test_an_explicit_data_size_must_use_every_trainer_gpu() -> None:
    assert "model.parallel.data: 4 x" in refusal("model.parallel.data=4")
    assert big_with("model.parallel.data=5").model.parallel.data == 5


def test_sequence_parallel_needs_tensor_parallel() -> None:
    message = refusal("model.parallel.tensor=1")
    assert "model.parallel.sequence_parallel: needs tensor > 1" in message
    assert "set tensor above 1 or sequence_parallel to false" in message


def test_pipeline_parallel_is_accepted_for_both_modes() -> None:
    assert big_with("model.parallel.pipeline=5").model.parallel.pipeline == 5
    assert "tensor 8 x pipeline 3 x context 1 = 24 does not divide" in refusal("model.parallel.pipeline=3")
    lora = big_with("model.parallel.pipeline=5", "model.train_mode=lora")
    assert (lora.model.train_mode, lora.model.parallel.pipeline) == ("lora", 5)


def test_context_parallel_is_accepted_for_both_modes_when_its_sizes_fit() -> None:
    tp4_cp2 = big_with("model.parallel.tensor=4", "model.parallel.context=2").model.parallel
    assert tp4_cp2.data_size(40) == 5
    assert "tensor 8 x pipeline 1 x context 3 = 24 does not divide" in refusal("model.parallel.context=3")
    lora = big_with("model.parallel.tensor=4", "model.parallel.context=2", "model.train_mode=lora")
    assert (lora.model.train_mode, lora.model.parallel.context) == ("lora", 2)


def test_a_context_size_the_max_context_does_not_cut_into_is_refused_when_the_preset_loads(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The preset's 131072 tokens cut into 2 x 2 chunks, not into 2 x 5: TP 8 x CP 5 on 40 GPUs is refused,
    also while its model (a hub name) is not on this machine, so submit cannot read its config.json."""
    wanted = "model.parallel.context: model.max_context 131072 must be a multiple of 2 x context (10)"
    message = refusal("model.parallel.context=5")
    assert wanted in message
    # the fix: the nearest lengths that cut, or the context sizes that cut this length
    assert "set model.max_context to 131070 or 131080, or context to one of [1, 2, 4, 8]" in message
    assert "multiple of 2 x context (4)" in refusal(
        "model.parallel.tensor=4", "model.parallel.context=2", "model.max_context=131070"
    )
    two = load_preset(str(local_big(tmp_path, tiny_model_dir, tensor=2, context=2, data=10)), env={})
    assert submit_problems(two, {}) == []


def test_parallel_sizes_on_the_transformers_backend_are_refused() -> None:
    assert "set model.backend=megatron" in refusal("model.backend=transformers")


def local_big(tmp_path: Path, model_dir: Path, **parallel) -> Path:
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "presets" / f"{BIG}.yaml").read_text())
    data["model"]["path"] = str(model_dir)
    data["model"]["parallel"] = {"tensor": 8, "sequence_parallel": True, **parallel}
    path = tmp_path / "big-local.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_submit_refuses_a_pipeline_that_does_not_divide_the_models_layers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tiny model has 2 layers: pipeline 4 (x tensor 2 x data 5) cannot cut them, pipeline 2 can."""
    uneven = load_preset(str(local_big(tmp_path, tiny_model_dir, tensor=2, pipeline=4)), env={})
    wanted = "model.parallel.pipeline: 4 must divide the model's 2 layers; choose pipeline from [1, 2]"
    assert wanted in submit_problems(uneven, {})
    even = load_preset(str(local_big(tmp_path, tiny_model_dir, tensor=2, pipeline=2)), env={})
    assert submit_problems(even, {}) == []


def test_submit_checks_the_sizes_against_a_local_models_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiny model has 4 heads, 2 KV heads, an MLP of 128 and 2 layers: TP 8 cannot cut it, TP 4 can."""
    problems = submit_problems(load_preset(str(local_big(tmp_path, tiny_model_dir)), env={}), {})
    choose = "; choose tensor from [1, 2, 4]"
    assert f"model.parallel.tensor: 8 must divide the model's 4 attention heads{choose}" in problems
    assert (
        f"model.parallel.tensor: 8 and the model's 2 KV heads must divide one another{choose}" not in problems
    )
    fits = load_preset(str(local_big(tmp_path, tiny_model_dir, tensor=4, data=10)), env={})
    assert submit_problems(fits, {}) == []


def test_a_model_the_mapping_does_not_know_is_refused_at_submit(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "llama"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    problems = submit_problems(load_preset(str(local_big(tmp_path, other, tensor=4, data=10)), env={}), {})
    assert any("model_type 'llama'" in p and "model.backend: transformers" in p for p in problems)


def shape(**changes) -> ModelShape:
    base = dict(
        hidden_size=64, num_layers=6, num_heads=12, num_kv_heads=4, head_dim=16, ffn_hidden_size=96,
        vocab_size=1200, tie_embeddings=False, max_position_embeddings=4096, rope_theta=1e6,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    return ModelShape(**{**base, **changes})


@pytest.mark.parametrize(
    ("layout", "wanted"),
    [
        (ParallelLayout(tensor=3), "3 and the model's 4 KV heads must divide one another"),
        (ParallelLayout(tensor=8), "tensor: 8 must divide the model's 12 attention heads"),
        (ParallelLayout(pipeline=4), "pipeline: 4 must divide the model's 6 layers"),
        (ParallelLayout(context=3), "max_context 4096 must be a multiple of 2 x context (6)"),
    ],
)
def test_model_problems_name_the_size_and_the_model_limit(layout: ParallelLayout, wanted: str) -> None:
    assert any(wanted in p for p in model_problems(layout, shape(), 4096))


@pytest.mark.parametrize(
    ("layout", "fix"),
    [
        # TP 6 and 3 cut the heads but not into whole KV groups of 4; 12 is a multiple of 4
        (ParallelLayout(tensor=3), "choose tensor from [1, 2, 4, 12]"),
        (ParallelLayout(tensor=8), "choose tensor from [1, 2, 4, 12]"),
        (ParallelLayout(pipeline=4), "choose pipeline from [1, 2, 3, 6]"),
        (ParallelLayout(context=3), "set model.max_context to 4092 or 4098, or context to one of [1, 2, 4]"),
    ],
)
def test_model_problems_name_the_fix(layout: ParallelLayout, fix: str) -> None:
    problems = model_problems(layout, shape(), 4096)
    assert len(problems) == 1 and problems[0].endswith(fix), problems


def test_the_backend_does_not_hold_the_models_own_context_length_to_2_x_context() -> None:
    """The backend checks the model it loads without a max_context (it pads each micro-batch to 2 x CP): a
    model whose max_position_embeddings 4094 is not a multiple of 6 runs at context 3."""
    assert model_problems(ParallelLayout(context=3), shape(max_position_embeddings=4094)) == []


def test_tp_larger_than_the_kv_heads_is_accepted_when_it_is_a_multiple() -> None:
    assert model_problems(ParallelLayout(tensor=4), shape(num_kv_heads=2, vocab_size=1024), 4096) == []
    assert gpu_problems(ParallelLayout(tensor=4, sequence_parallel=True), 8) == []


def test_lora_on_the_megatron_backend_is_accepted_at_submit(tiny_model_dir: Path, tmp_path: Path) -> None:
    preset = str(local_big(tmp_path, tiny_model_dir, tensor=4, data=10))
    lora = load_preset(preset, ["model.train_mode=lora"], env={})
    full = load_preset(preset, ["model.train_mode=full"], env={})
    assert submit_problems(lora, {}) == submit_problems(full, {})
    assert not any("train_mode" in p for p in submit_problems(lora, {}))
