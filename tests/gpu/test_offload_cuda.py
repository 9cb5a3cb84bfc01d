"""The trainer's state off the GPU while colocated engines sample (miles/train/backends/offload.py): the
optimizer state and gradients leave the device (the memory is the engine's to use), come back bit for bit,
and the next step is the step an un-offloaded trainer takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROWS = [[3, 17, 90, 4, 55, 21, 8], [8, 8, 300, 12, 9]]


def _data() -> list[Datum]:
    out = []
    for row in ROWS:
        tokens = np.array(row, dtype=np.int64)
        weights = np.ones(len(row) - 1, dtype=np.float32)
        out.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return out


def _backend(model_dir: Path) -> TransformersBackend:
    return TransformersBackend(str(model_dir), train_mode="full", device="cuda", compile_layers=False)


def _step(backend: TransformersBackend) -> None:
    backend.forward_backward("full", _data(), "cross_entropy", {})
    backend.optim_step("full", AdamParams(learning_rate=1e-3))


def test_offload_frees_the_device_and_reload_gives_the_same_next_step(tiny_model_dir: Path) -> None:
    plain, moved = _backend(tiny_model_dir), _backend(tiny_model_dir)
    for backend in (plain, moved):
        _step(backend)
        backend.forward_backward("full", _data(), "cross_entropy", {})  # gradients pending
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sizes = moved.offload_train_state(["optimizer", "gradients"])
    assert sizes["optimizer"] > 0 and sizes["gradients"] > 0
    assert torch.cuda.memory_allocated() <= before - sizes["optimizer"] - sizes["gradients"]
    assert all(p.grad is None for p in moved._full_model.parameters())
    assert moved.reload_train_state() == sizes["optimizer"] + sizes["gradients"]
    for backend in (plain, moved):
        backend.optim_step("full", AdamParams(learning_rate=1e-3))
    for a, b in zip(plain._full_model.parameters(), moved._full_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
