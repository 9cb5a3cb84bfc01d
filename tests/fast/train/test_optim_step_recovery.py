"""Out of memory in optim_step is the request's user error, with nothing changed.

The step allocates everything it needs before it changes anything (miles/train/backends/optim_guard.py):
Adam's moments on the first step, zero gradients for parameters no forward_backward reached, and the
data-parallel flat buffer. The failure is injected for real at those allocations: on its n-th call the
allocating function first asks torch's allocator for 4 PiB, which it refuses. Parameters, pending
gradients and optimizer state must then be exactly (torch.equal) as before, and the same optim_step sent
again must end exactly where a run that never failed ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from miles.errors import UserError
from miles.train.backends import optim, optim_guard
from miles.types import AdamParams
from tests.fast.train.test_step_recovery import (
    ADAM,
    IMPOSSIBLE_BYTES,
    assert_same,
    assert_same_logprobs,
    batch,
    new_backend,
    state_of,
)


@contextlib.contextmanager
def allocation_failure_in(name: str, on_call: int) -> Iterator[list[int]]:
    """While active, the `on_call`-th call of optim_guard.<name> first tries an impossible allocation."""
    real: Callable = getattr(optim_guard, name)
    calls = [0]

    def failing(*args: object) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == on_call:
            torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)
        return real(*args)

    setattr(optim_guard, name, failing)
    try:
        yield calls
    finally:
        setattr(optim_guard, name, real)


def optimizer_of(backend, key: str) -> torch.optim.Optimizer | None:
    return backend._trainables[backend._trainable_key(key)].optimizer


def test_adam_state_made_before_the_step_is_what_torch_makes_and_steps_the_same() -> None:
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    theirs.load_state_dict(ours.state_dict())
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.0)
    mine = optim.new_adamw(list(ours.parameters()), adam)
    plain = torch.optim.AdamW(
        theirs.parameters(),
        lr=1e-2,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=0.1,
        fused=True,
    )  # its state made lazily, inside its first step
    assert mine.param_groups[0]["fused"]  # the in-place kernel on CPU too
    for step in range(3):
        grads = [torch.randn_like(p) for p in ours.parameters()]
        for model, grad_list in ((ours, grads), (theirs, [g.clone() for g in grads])):
            for param, grad in zip(model.parameters(), grad_list, strict=True):
                param.grad = grad
        optim_guard.guarded_optim_step(mine, list(ours.parameters()), adam, None, torch.device("cpu"))
        plain.step()
        plain.zero_grad(set_to_none=True)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"
            assert mine.state[a].keys() == plain.state[b].keys()
            for k, value in mine.state[a].items():
                other = plain.state[b][k]
                assert (value.dtype, value.device, value.shape) == (other.dtype, other.device, other.shape), k
                assert torch.equal(value, other), k


CASES = {
    # the first step: Adam's moments do not exist yet; the third moment is the second parameter's second
    "first step, Adam's moments": ("new_moment", 3, False),
    # a later step without a forward_backward since the last one: every gradient is a new zero tensor
    "later step, zero gradients": ("new_gradient", 2, True),
}


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_out_of_memory_preparing_optim_step_changes_nothing_and_the_step_can_be_sent_again(
    tiny_model_dir: Path, mode: str, case: str
) -> None:
    where, on_call, later_step = CASES[case]
    survivor, key = new_backend(tiny_model_dir, mode)
    reference, _ = new_backend(tiny_model_dir, mode)
    for backend in (survivor, reference):
        backend.forward_backward(key, batch(1, (6, 8)), "cross_entropy", {})
        if later_step:
            backend.optim_step(key, ADAM)  # Adam has state; no gradients pending now

    before = state_of(survivor, key)
    assert bool(before["optimizer"]) == later_step
    with allocation_failure_in(where, on_call) as calls, pytest.raises(UserError) as failed:
        survivor.optim_step(key, ADAM)
    assert calls[0] == on_call
    message = str(failed.value)
    assert "optim_step ran out of device memory" in message and "can't allocate memory" in message
    assert "Nothing was changed" in message
    assert_same(state_of(survivor, key), before)
    assert (optimizer_of(survivor, key) is None) == (not later_step)  # a failed first step made none

    # the same step sent again, then another: bit for bit where the reference is
    for backend in (survivor, reference):
        backend.optim_step(key, ADAM)
        backend.forward_backward(key, batch(2, (7, 5)), "cross_entropy", {})
        backend.optim_step(key, ADAM)
    assert_same(state_of(survivor, key), state_of(reference, key))
    assert_same_logprobs(survivor, reference, key)


def test_an_error_preparing_optim_step_that_is_not_memory_stays_a_server_error(tiny_model_dir: Path) -> None:
    backend, key = new_backend(tiny_model_dir, "lora")
    backend.forward_backward(key, batch(1, (6,)), "cross_entropy", {})
    before = state_of(backend, key)
    real = optim_guard.new_moment

    def broken(param: torch.nn.Parameter) -> torch.Tensor:
        if broken.calls == 2:
            raise RuntimeError("a bug, not memory")
        broken.calls += 1
        return real(param)

    broken.calls = 0  # type: ignore[attr-defined]
    optim_guard.new_moment = broken
    try:
        with pytest.raises(RuntimeError, match="a bug, not memory") as raised:
            backend.optim_step(key, ADAM)
    finally:
        optim_guard.new_moment = real
    assert not isinstance(raised.value, UserError)
    assert_same(state_of(backend, key), before)  # what it allocated was dropped all the same
