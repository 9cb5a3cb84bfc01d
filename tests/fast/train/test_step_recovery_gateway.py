"""Through the gateway with the real tinker SDK: an oversized request fails as the caller's error, the next
one trains, and the model ends exactly where a run without the failed request ends.

The gateway (the driver's uvicorn server, on loopback) serves the local runtime: a TransformersBackend in
this process and a CPU engine subprocess. The out-of-memory error is a real allocator failure injected into
the backward pass of the oversized request (a gradient hook asks for 4 PiB); the token budget
(runtime.max_batch_tokens) refuses a batch over it before any compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum
from tests.fast.local_gateway import cpu_engine, local_gateway

pytestmark = pytest.mark.slow

KEY = "tml-oom-recovery-0001"
MODEL = "tiny"
BUDGET = 40
LR = 1e-2
IMPOSSIBLE_BYTES = 1 << 52


class AllocationFailure:
    """Armed, the second gradient computed for `param` first asks the allocator for 4 PiB."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.armed = False
        self.calls = 0
        param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
            if self.calls == 2:
                torch.empty(IMPOSSIBLE_BYTES, dtype=torch.uint8)
        return grad


def rows(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n + 1).tolist() for n in lengths]


def sdk_data(token_rows: list[list[int]]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
        )
        for r in token_rows
    ]


def ref_data(token_rows: list[list[int]]) -> list[Datum]:
    return [
        Datum(
            np.asarray(r[:-1], np.int64),
            {"target_tokens": np.asarray(r[1:], np.int64), "weights": np.ones(len(r) - 1, np.float32)},
        )
        for r in token_rows
    ]


def new_backend(model_dir: Path) -> TransformersBackend:
    # 16 tokens per micro-batch: every datum below is a micro-batch of its own
    return TransformersBackend(
        str(model_dir), train_mode="lora", max_tokens_per_micro_batch=16, max_batch_tokens=BUDGET
    )


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, TransformersBackend]]:
    backend = new_backend(tiny_model_dir)
    with cpu_engine(tiny_model_dir, tmp_path / "engine.log") as engine:
        runtime = LocalRuntime(tiny_model_dir, model_name=MODEL, engine=engine, backend=backend)
        with local_gateway(runtime, tmp_path / "ckpt", KEY) as url:
            yield url, backend


def test_an_oversized_request_fails_alone_and_training_goes_on(served, tiny_model_dir: Path) -> None:
    url, backend = served
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    key = backend.model_keys()[0]
    initial = {n: p.detach().clone() for n, p in backend.named_trainable_parameters(key)}
    failure = AllocationFailure(backend.named_trainable_parameters(key)[0][1])
    first, second, oversized = rows(1, [6, 8]), rows(2, [7, 5]), rows(3, [9, 9, 9])

    tc.forward_backward(sdk_data(first), "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError) as over_budget:  # 45 tokens > 40: refused unrun
        tc.forward_backward(sdk_data(rows(4, [15, 15, 15])), "cross_entropy").result()
    assert over_budget.value.category == RequestErrorCategory.User
    assert "budget of 40 tokens (runtime.max_batch_tokens)" in str(over_budget.value)
    failure.armed = True
    with pytest.raises(tinker.RequestFailedError) as out_of_memory:
        tc.forward_backward(sdk_data(oversized), "cross_entropy").result()
    failure.armed = False
    assert failure.calls == 2  # it failed inside the second micro-batch's backward
    assert out_of_memory.value.category == RequestErrorCategory.User
    assert "ran out of device memory on a batch of 3 datums, 27 tokens" in str(out_of_memory.value)

    got = tc.forward_backward(sdk_data(second), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    probe = tc.forward(sdk_data(rows(5, [10])), "cross_entropy").result()

    # the same run without the two failed requests, on a backend with the same initial adapter
    reference = new_backend(tiny_model_dir)
    reference.create_adapter(key, backend._lora.get(key).spec)
    with torch.no_grad():
        for name, param in reference.named_trainable_parameters(key):
            param.copy_(initial[name])
    reference.forward_backward(key, ref_data(first), "cross_entropy", {})
    want = reference.forward_backward(key, ref_data(second), "cross_entropy", {})
    reference.optim_step(key, AdamParams(learning_rate=LR))
    want_probe = reference.forward_backward(key, ref_data(rows(5, [10])), "cross_entropy", {}, True)

    for out, ref in ((got, want), (probe, want_probe)):
        got_lp = [np.asarray(o["logprobs"].data, np.float32) for o in out.loss_fn_outputs]
        for lp, ref_lp in zip(got_lp, ref.logprobs, strict=True):
            np.testing.assert_array_equal(lp, ref_lp)
    trained = dict(backend.named_trainable_parameters(key))
    for name, param in reference.named_trainable_parameters(key):
        assert torch.equal(trained[name], param), f"{name} differs from the run without the failed requests"
