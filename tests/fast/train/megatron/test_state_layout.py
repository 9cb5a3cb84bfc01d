"""Which megatron full fine-tuning checkpoint loads under which layout (pure; runs in CI without
megatron-core): the weights at any data and context size, the optimizer only under the layout that wrote it,
and each refusal naming the layout saved, the one running and the fix."""

from __future__ import annotations

from typing import Any

from miles.train.megatron.state_layout import running_layout, state_layout_problem


def saved(**changes: Any) -> dict[str, Any]:
    meta = {"format": 1, "backend": "megatron", "train_mode": "full", "tensor": 2, "pipeline": 2}
    return {**meta, "context": 2, "data": 1, **changes}


HERE = running_layout(tensor=2, pipeline=2, context=2, data=1)


def test_the_same_layout_loads_with_and_without_the_optimizer() -> None:
    assert state_layout_problem(saved(), HERE, optimizer=True) is None
    assert state_layout_problem(saved(), HERE, optimizer=False) is None


def test_the_weights_load_at_another_context_and_data_size() -> None:
    for context, data in ((1, 1), (1, 2), (4, 3)):
        mine = running_layout(tensor=2, pipeline=2, context=context, data=data)
        assert state_layout_problem(saved(), mine, optimizer=False) is None


def test_the_optimizer_at_another_context_size_names_both_layouts_and_the_fixes() -> None:
    mine = running_layout(tensor=2, pipeline=2, context=1, data=2)
    problem = state_layout_problem(saved(), mine, optimizer=True)
    assert problem is not None
    assert "saved at (format 1, backend megatron, tensor 2, pipeline 2, context 2, data 1)" in problem
    assert (
        "this trainer runs (format 1, backend megatron, tensor 2, pipeline 2, context 1, data 2)" in problem
    )
    assert "run model.parallel context=2 data=1" in problem and "without the optimizer" in problem


def test_another_tensor_or_pipeline_size_names_the_sizes_to_run() -> None:
    for mine in (running_layout(1, 2, 2, 1), running_layout(2, 1, 2, 1)):
        for optimizer in (True, False):
            problem = state_layout_problem(saved(), mine, optimizer=optimizer)
            assert problem is not None and "run model.parallel tensor=2 pipeline=2" in problem


def test_a_checkpoint_from_before_the_pipeline_and_context_keys_is_pipeline_and_context_1() -> None:
    old = {k: v for k, v in saved().items() if k not in ("pipeline", "context")}
    assert state_layout_problem(old, running_layout(2, 1, 1, 1), optimizer=True) is None


def test_a_lora_or_transformers_checkpoint_is_named_as_such() -> None:
    lora = {"format": 1, "backend": "megatron", "train_mode": "lora"}
    problem = state_layout_problem(lora, HERE, optimizer=False)
    assert problem is not None and "'lora' checkpoint of backend 'megatron'" in problem
    transformers = {"format": 1, "backend": "transformers", "train_mode": "full"}
    problem = state_layout_problem(transformers, HERE, optimizer=False)
    assert problem is not None and "backend 'transformers'" in problem and "kind that wrote it" in problem
