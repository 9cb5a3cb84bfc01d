"""The trainer side of the colocated push (miles/weights/ipc_sender.py) and the driver's pairing of ranks
with engines (miles/weights/ipc_push.py), on CPU: payloads a receiver can open, buckets by bytes, and a
rank that cannot share failing the push instead of the trainer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles.train.backends.transformers_backend import TransformersBackend
from miles.utils.tensor_ipc import deserialize_flattened_bucket, deserialize_named_tensors
from miles.weights.ipc_push import _payloads_per_engine
from miles.weights.ipc_sender import (
    _PLANS,
    _SHARED,
    ReleaseSharedWeights,
    SharedBuckets,
    ShareWeightBuckets,
    copy_pays,
)
from miles.weights.push import WeightPushError


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(tiny_model_dir), train_mode="full")


@pytest.fixture
def copies_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy buckets on CPU as on CUDA (on CPU a copy costs more than it saves: copy_pays says no)."""
    monkeypatch.setattr("miles.weights.ipc_sender.copy_pays", lambda named: True)


def test_buckets_are_copied_on_cuda_only() -> None:
    assert copy_pays([("w", torch.ones(2))]) is False


def test_buckets_hold_handles_to_the_trainers_own_weights(backend: TransformersBackend) -> None:
    weights = dict(backend.iter_hf_weights())
    total = sum(t.numel() * t.element_size() for t in weights.values())
    shared = ShareWeightBuckets(bucket_bytes=total // 3, flattened=False).run(backend)
    assert shared.error is None and len(shared.payloads) >= 3
    assert shared.load_formats == [None] * len(shared.payloads)
    received = [pair for payload in shared.payloads for pair in deserialize_named_tensors(payload)]
    assert [len(deserialize_named_tensors(p)) for p in shared.payloads] == shared.tensors
    assert sum(shared.bytes) == sum(t.numel() * t.element_size() for _, t in received)
    for name, tensor in received:
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    assert len(_SHARED) == len(received)  # kept alive on the rank until the engines answered
    assert ReleaseSharedWeights().run(backend) == len(received) and not _SHARED


def test_flattened_buckets_are_copies_the_trainer_may_step_past(
    backend: TransformersBackend, copies_pay
) -> None:
    weights = {name: tensor.clone() for name, tensor in backend.iter_hf_weights()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    shared = ShareWeightBuckets(bucket_bytes=total // 3).run(backend)
    assert shared.error is None and len(shared.payloads) >= 3
    assert shared.load_formats == ["flattened_bucket"] * len(shared.payloads)
    buckets = [deserialize_flattened_bucket(payload) for payload in shared.payloads]
    assert [len(b) for b in buckets] == shared.tensors
    live = [tensor for _, tensor in backend.iter_hf_weights()]
    with torch.no_grad():  # an optimizer step after the share: what the engines read must not move
        torch._foreach_add_(live, 1.0)
    try:
        for name, tensor in (pair for bucket in buckets for pair in bucket):
            torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    finally:
        with torch.no_grad():
            torch._foreach_sub_(live, 1.0)
    held = len(weights) + len(
        shared.payloads
    )  # the weights and each bucket's buffer, until the engines answer
    assert len(_SHARED) == held
    assert ReleaseSharedWeights().run(backend) == held and not _SHARED


def _flattened_values(shared: SharedBuckets) -> dict[str, torch.Tensor]:
    return {
        name: tensor.clone()
        for payload in shared.payloads
        for name, tensor in deserialize_flattened_bucket(payload)
    }


def test_the_plan_is_kept_while_the_weights_stay_where_they_are(
    backend: TransformersBackend, copies_pay
) -> None:
    first = ShareWeightBuckets(bucket_bytes=1 << 14).run(backend)
    plan = _PLANS[(1 << 14, True)]
    ReleaseSharedWeights().run(backend)
    live = [tensor for _, tensor in backend.iter_hf_weights()]
    with torch.no_grad():
        torch._foreach_add_(live, 0.5)  # an optimizer step: values change in place
    try:
        second = ShareWeightBuckets(bucket_bytes=1 << 14).run(backend)
        assert _PLANS[(1 << 14, True)] is plan
        assert second.bytes == first.bytes and second.tensors == first.tensors
        before, after = _flattened_values(first), _flattened_values(second)
        assert before.keys() == after.keys() and len(before) == sum(first.tensors)
        for name, tensor in after.items():  # the kept views pack the current values
            torch.testing.assert_close(tensor, before[name] + 0.5, rtol=0, atol=1e-6)
        ShareWeightBuckets(bucket_bytes=1 << 15).run(backend)  # another bucket size, another plan
        assert _PLANS[(1 << 14, True)] is plan and _PLANS[(1 << 15, True)] is not plan
    finally:
        ReleaseSharedWeights().run(backend)
        with torch.no_grad():
            torch._foreach_sub_(live, 0.5)


def test_weights_that_moved_get_a_new_plan(tiny_model_dir: Path, copies_pay) -> None:
    moved = TransformersBackend(str(tiny_model_dir), train_mode="full")
    ShareWeightBuckets(bucket_bytes=1 << 30).run(moved)
    plan = _PLANS[(1 << 30, True)]
    name, param = next(iter(moved._full_model.named_parameters()))
    param.data = param.data.clone() + 1.0  # new memory (a load that replaced the tensor)
    try:
        shared = ShareWeightBuckets(bucket_bytes=1 << 30).run(moved)
        assert len(_PLANS) == 1 and _PLANS[(1 << 30, True)] is not plan  # the old walk's are gone
        torch.testing.assert_close(_flattened_values(shared)[name], param.data, rtol=0, atol=0)
    finally:
        ReleaseSharedWeights().run(moved)


@pytest.mark.parametrize(
    ("flattened", "to_device", "emptied"), [(True, False, 0), (True, True, 1), (False, True, 0)]
)
def test_copies_go_back_to_the_device_only_when_asked(
    backend: TransformersBackend, monkeypatch, copies_pay, flattened: bool, to_device: bool, emptied: int
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    ShareWeightBuckets(bucket_bytes=1 << 30, flattened=flattened).run(backend)
    ReleaseSharedWeights(to_device).run(backend)
    assert len(calls) == emptied and not _SHARED


def test_a_bucket_whose_copy_does_not_fit_goes_as_handles(
    backend: TransformersBackend, monkeypatch, copies_pay
) -> None:
    def no_room(layout):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.1 GiB")

    monkeypatch.setattr("miles.utils.tensor_ipc.FlattenedLayout.pack", no_room)
    shared = ShareWeightBuckets(bucket_bytes=1 << 30).run(backend)
    assert shared.error is None and shared.load_formats == [None]
    assert len(deserialize_named_tensors(shared.payloads[0])) == shared.tensors[0]
    ReleaseSharedWeights().run(backend)


def test_a_rank_that_cannot_share_answers_an_error_instead_of_raising() -> None:
    class Broken:
        def iter_hf_weights(self):
            raise RuntimeError("cudaIpcGetMemHandle failed")

    answer = ShareWeightBuckets(bucket_bytes=1 << 20).run(Broken())  # type: ignore[arg-type]
    assert answer.error == "RuntimeError: cudaIpcGetMemHandle failed" and answer.payloads == []
    engines = [SimpleNamespace(index=0, name="engine cell 0")]
    with pytest.raises(WeightPushError, match=r"rank 0: RuntimeError: cudaIpcGetMemHandle failed"):
        _payloads_per_engine([answer], engines)


def test_engine_i_gets_rank_is_payloads() -> None:
    flat = "flattened_bucket"
    ranks = [
        SharedBuckets([f"r{rank}b0", f"r{rank}b1"], [1, 1], [4, 4], None, [flat, None]) for rank in range(3)
    ]
    ranks[2] = SharedBuckets(["r2b0", "r2b1"], [1, 1], [4, 4], None, [None, None])  # short of memory
    engines = [SimpleNamespace(index=i, name=f"engine cell {i}") for i in (2, 0)]
    assert _payloads_per_engine(ranks, engines) == [
        [("r2b0", None), ("r2b1", None)],
        [("r0b0", flat), ("r0b1", None)],
    ]
    stray = [SimpleNamespace(index=3, name="engine cell 3")]
    with pytest.raises(WeightPushError, match="engine cell 3 has no trainer rank on its GPU"):
        _payloads_per_engine(ranks, stray)


def test_a_strided_weight_is_packed_afresh_every_push(copies_pay) -> None:
    class Strided:  # a weight the walk sees transposed: its contiguous form is a copy that would go stale
        def __init__(self) -> None:
            self.weight = torch.arange(12.0).reshape(3, 4)

        def iter_hf_weights(self):
            yield "w.weight", self.weight.t()

        def push_layout_key(self):
            return (self.weight.data_ptr(),)

    backend = Strided()
    try:
        ShareWeightBuckets(bucket_bytes=1 << 20).run(backend)  # type: ignore[arg-type]
        assert not _PLANS
        backend.weight.add_(1.0)
        shared = ShareWeightBuckets(bucket_bytes=1 << 20).run(backend)  # type: ignore[arg-type]
        torch.testing.assert_close(_flattened_values(shared)["w.weight"], backend.weight.t(), rtol=0, atol=0)
    finally:
        ReleaseSharedWeights().run(backend)  # type: ignore[arg-type]
