"""A real CUDA out-of-memory error in forward_backward is the request's user error; the trainer goes on.

Cheap: the process's share of the GPU is capped (torch.cuda.set_per_process_memory_fraction), so the caching
allocator itself raises torch.cuda.OutOfMemoryError on a batch of a few million tokens of the tiny model,
in a second or two. The failed call leaves parameters, pending gradients and optimizer state bit for bit as
before, gives its memory back, and the next normal batches train to where a run that never saw the
oversized request gets. (tests/fast/train/test_step_recovery.py fails mid-backward on CPU.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.errors import UserError
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

pytestmark = pytest.mark.gpu

VOCAB = 1024
MEMORY_CAP_BYTES = 6 << 30  # the oversized batch below needs far more; the tiny model far less
ADAM = AdamParams(learning_rate=1e-2)


def batch(seed: int, lengths: list[int]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int64)
        weights = np.ones(n, np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


@pytest.fixture
def capped_gpu() -> Iterator[None]:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(MEMORY_CAP_BYTES / total, 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def new_backend(model_dir: Path, mode: str) -> TransformersBackend:
    # one micro-batch for the whole batch and full logits: the oversized batch is one huge allocation
    backend = TransformersBackend(
        str(model_dir),
        train_mode=mode,
        device="cuda",
        max_tokens_per_micro_batch=1 << 40,
        logprob_chunk_tokens=0,
        compile_layers=False,
    )
    if mode == "lora":
        backend.create_adapter("m", LoraSpec(rank=4, alpha=8.0, seed=3))
    return backend


def state_of(backend: TransformersBackend) -> dict[str, torch.Tensor | None]:
    named = backend.named_trainable_parameters("m")
    optimizer = backend._trainables[backend._trainable_key("m")].optimizer
    state: dict[str, torch.Tensor | None] = {}
    for name, param in named:
        state[f"param {name}"] = param.detach().clone()
        state[f"grad {name}"] = None if param.grad is None else param.grad.detach().clone()
        for key, value in (optimizer.state.get(param, {}) if optimizer else {}).items():
            state[f"optimizer {name} {key}"] = torch.as_tensor(value).detach().clone()
    return state


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_real_cuda_oom_is_a_user_error_and_training_goes_on(tiny_model_dir, capped_gpu, mode) -> None:
    first, second = batch(1, [64, 48]), batch(2, [32, 80])
    survivor, reference = new_backend(tiny_model_dir, mode), new_backend(tiny_model_dir, mode)
    for backend in (survivor, reference):
        backend.forward_backward("m", first, "cross_entropy", {})
        backend.optim_step("m", ADAM)
        backend.forward_backward("m", second, "cross_entropy", {})
    before = state_of(survivor)
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()

    oversized = batch(3, [2000] * 1000)  # 2 M tokens: its full fp32 logits alone are 8 GiB
    with pytest.raises(UserError, match="ran out of device memory on a batch of 1000 datums") as failed:
        survivor.forward_backward("m", oversized, "cross_entropy", {})
    assert "CUDA out of memory" in str(failed.value)

    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated_before + (1 << 20)  # the call's memory came back
    after = state_of(survivor)
    assert after.keys() == before.keys()
    for name, value in before.items():
        got = after[name]
        assert (got is None and value is None) or torch.equal(got, value), f"{name} changed"

    for backend in (survivor, reference):
        backend.forward_backward("m", first, "cross_entropy", {})
        backend.optim_step("m", ADAM)
    # atomics in CUDA backward kernels may reorder float sums between two runs: close, not bitwise
    want = state_of(reference)
    for name, value in state_of(survivor).items():
        if value is not None:
            torch.testing.assert_close(
                value, want[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
