"""Oversized work is the request's user error, never the trainer's end.

The token budget (runtime.max_batch_tokens) refuses a batch in preflight, naming the budget and the batch's
size. An allocation failure in the middle of a backward pass is injected for real: a gradient hook asks the
allocator for 4 PiB, which torch's CPU allocator (or CUDA's) refuses. The call fails with a UserError, and
the parameters, the gradients accumulated by earlier calls of the step and the optimizer state are exactly
(torch.equal) what they were; training then continues to the same result as a run that never saw the
failed request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from peft.tuners.lora import LoraLayer

from miles.errors import UserError
from miles.train.backends.step_guard import is_out_of_memory
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.preflight import preflight
from miles.types import AdamParams, Datum, LoraSpec

VOCAB = 1024
ADAM = AdamParams(learning_rate=1e-2)
IMPOSSIBLE_BYTES = 1 << 52  # 4 PiB: no allocator grants it


def batch(seed: int, lengths: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int64)
        weights = rng.uniform(0.2, 1.0, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


@contextlib.contextmanager
def allocation_failure_in_backward(param: torch.nn.Parameter, on_call: int) -> Iterator[list[int]]:
    """While active, the `on_call`-th gradient computed for `param` first tries an impossible allocation.
    With one datum per micro-batch, on_call=2 fails the second micro-batch's backward, after the first
    one's gradients were accumulated."""
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == on_call:
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8, device=grad.device)
        return grad

    handle = param.register_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def new_backend(model_dir: Path, mode: str, **kw) -> tuple[TransformersBackend, str]:
    # 16 tokens per micro-batch: each datum of the batches below is a micro-batch of its own
    backend = TransformersBackend(str(model_dir), train_mode=mode, max_tokens_per_micro_batch=16, **kw)
    if mode == "lora":
        backend.create_adapter("m", LoraSpec(rank=4, alpha=8.0, seed=3))
    return backend, "m"


def state_of(backend: TransformersBackend, key: str) -> dict[str, object]:
    """Parameters, pending gradients and optimizer state, cloned."""
    named = backend.named_trainable_parameters(key)
    optimizer = backend._trainables[backend._trainable_key(key)].optimizer
    opt_state = {}
    if optimizer is not None:
        for name, param in named:
            for k, v in optimizer.state.get(param, {}).items():
                opt_state[f"{name}::{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return {
        "params": {n: p.detach().clone() for n, p in named},
        "grads": {n: None if p.grad is None else p.grad.detach().clone() for n, p in named},
        "optimizer": opt_state,
    }


def assert_same(actual: dict, expected: dict) -> None:
    for part in ("params", "grads", "optimizer"):
        assert actual[part].keys() == expected[part].keys(), part
        for name, value in expected[part].items():
            got = actual[part][name]
            if value is None or got is None:
                assert got is None and value is None, f"{part} {name}"
            elif torch.is_tensor(value):
                assert torch.equal(got, value), f"{part} {name} changed"
            else:
                assert got == value, f"{part} {name} changed"


def assert_same_logprobs(survivor: TransformersBackend, reference: TransformersBackend, key: str) -> None:
    """Both backends answer a probe batch with the same logprobs, bit for bit."""
    probe = batch(4, (10,))
    got = survivor.forward_backward(key, probe, "cross_entropy", {}, forward_only=True)
    want = reference.forward_backward(key, probe, "cross_entropy", {}, forward_only=True)
    np.testing.assert_array_equal(got.logprobs[0], want.logprobs[0])


def test_preflight_refuses_a_batch_over_the_token_budget_naming_budget_and_size() -> None:
    data = batch(0, (5, 9, 7))  # 21 tokens
    kw = {"vocab_size": VOCAB, "max_context": 64}
    assert preflight(data, "cross_entropy", {}, max_batch_tokens=21, **kw).loss.name == "cross_entropy"
    with pytest.raises(UserError) as refused:
        preflight(data, "cross_entropy", {}, max_batch_tokens=20, **kw)
    message = str(refused.value)
    assert "3 datums has 21 tokens" in message and "budget of 20 tokens" in message
    assert "runtime.max_batch_tokens" in message


def test_the_backend_enforces_its_budget_and_keeps_training(tiny_model_dir: Path) -> None:
    backend, key = new_backend(tiny_model_dir, "lora", max_batch_tokens=20)
    before = state_of(backend, key)
    with pytest.raises(UserError, match="over this server's per-request budget of 20 tokens"):
        backend.forward_backward(key, batch(0, (5, 9, 7)), "cross_entropy", {})
    assert_same(state_of(backend, key), before)
    out = backend.forward_backward(key, batch(0, (5, 9)), "cross_entropy", {})
    assert len(out.logprobs) == 2


def test_an_allocation_error_that_is_not_out_of_memory_is_not_taken_for_one() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_out_of_memory_mid_backward_leaves_model_grads_and_optimizer_as_before(
    tiny_model_dir: Path, mode: str
) -> None:
    first, second, oversized = batch(1, (6, 8)), batch(2, (7, 5)), batch(3, (9, 9, 9))
    survivor, key = new_backend(tiny_model_dir, mode)
    reference, _ = new_backend(tiny_model_dir, mode)
    for backend in (survivor, reference):  # a step first, so the optimizer has state to keep
        backend.forward_backward(key, first, "cross_entropy", {})
        backend.optim_step(key, ADAM)
        backend.forward_backward(key, second, "cross_entropy", {})  # gradients pending in this step

    before = state_of(survivor, key)
    assert before["optimizer"] and all(g is not None for g in before["grads"].values())
    hooked = survivor.named_trainable_parameters(key)[0][1]
    with allocation_failure_in_backward(hooked, on_call=2) as calls, pytest.raises(UserError) as failed:
        survivor.forward_backward(key, oversized, "cross_entropy", {})
    assert calls[0] == 2  # it failed inside the second micro-batch's backward
    message = str(failed.value)
    assert "ran out of device memory on a batch of 3 datums, 27 tokens" in message
    assert "can't allocate memory" in message
    assert_same(state_of(survivor, key), before)

    # serving goes on, to exactly where a run without the failed request gets
    for backend in (survivor, reference):
        backend.forward_backward(key, first, "cross_entropy", {})
        backend.optim_step(key, ADAM)
    assert_same(state_of(survivor, key), state_of(reference, key))
    assert_same_logprobs(survivor, reference, key)


def test_out_of_memory_in_a_forward_only_call_is_a_user_error_too(tiny_model_dir: Path) -> None:
    backend, key = new_backend(tiny_model_dir, "lora")
    backend.forward_backward(key, batch(1, (6,)), "cross_entropy", {})
    before = state_of(backend, key)
    layer = backend.named_trainable_parameters(key)[0][1]

    def allocate(*_: object) -> None:
        torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)

    # forward-only runs without autograd: fail in a forward hook of the LoRA layer that holds `layer` (it
    # reads its adapters' weights itself, without calling their Linear modules: lora_layer.py)
    model = backend._activate(key)[0]
    module = next(
        m for m in model.modules() if isinstance(m, LoraLayer) and any(p is layer for p in m.parameters())
    )
    handle = module.register_forward_hook(allocate)
    try:
        with pytest.raises(UserError, match="forward ran out of device memory"):
            backend.forward_backward(key, batch(5, (4, 4)), "cross_entropy", {}, forward_only=True)
    finally:
        handle.remove()
    assert_same(state_of(backend, key), before)


def test_other_runtime_errors_still_fail_the_call_as_they_are(tiny_model_dir: Path) -> None:
    backend, key = new_backend(tiny_model_dir, "lora")
    backend.forward_backward(key, batch(2, (5,)), "cross_entropy", {})
    before = state_of(backend, key)
    hooked = backend.named_trainable_parameters(key)[0][1]

    def broken(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bug, not memory")

    handle = hooked.register_hook(broken)
    try:
        with pytest.raises(RuntimeError, match="a bug, not memory") as raised:
            backend.forward_backward(key, batch(1, (6,)), "cross_entropy", {})
    finally:
        handle.remove()
    assert not isinstance(raised.value, UserError)  # a server error, as before
    assert_same(state_of(backend, key), before)  # and the step's earlier gradients are still there
