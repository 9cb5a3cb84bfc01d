"""On CUDA, the fast paths of TransformersBackend (chunked lm_head + checkpointed logprobs, compiled decoder
layers, fused AdamW) give the same logprobs, gradients and step as the plain full-logits eager path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum, LoraSpec

pytestmark = pytest.mark.gpu


def _batch(lengths: tuple[int, ...] = (13, 29, 21), vocab: int = 1024) -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for n in lengths:
        tokens = rng.integers(0, vocab, n + 1).astype(np.int64)
        weights = rng.uniform(0, 1, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def _run(model_dir: Path, mode: str, dtype: torch.dtype, **options) -> tuple[list[np.ndarray], dict, list]:
    backend = TransformersBackend(str(model_dir), train_mode=mode, device="cuda", dtype=dtype, **options)
    key = "k"
    if mode == "lora":
        backend.create_adapter(key, LoraSpec(rank=4, alpha=8.0, seed=3))
    out = backend.forward_backward(key, _batch(), "cross_entropy", {})
    grads = {n: p.grad.detach().float().cpu() for n, p in backend.named_trainable_parameters(key)}
    backend.optim_step(key, AdamParams(learning_rate=1e-3))
    again = backend.forward_backward(key, _batch(), "cross_entropy", {}, forward_only=True)
    return out.logprobs, grads, again.logprobs


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"]
)
def test_chunked_compiled_equals_full_logits_eager(
    tiny_model_dir: Path, mode: str, dtype: torch.dtype, tol: float
) -> None:
    plain = _run(tiny_model_dir, mode, dtype, logprob_chunk_tokens=0, compile_layers=False)
    fast = _run(tiny_model_dir, mode, dtype, logprob_chunk_tokens=7, compile_layers=True)
    for a, b in zip(plain[0], fast[0], strict=True):
        np.testing.assert_allclose(b, a, atol=tol, rtol=tol)
    assert plain[1].keys() == fast[1].keys()
    for name, grad in plain[1].items():
        scale = float(grad.abs().max()) + 1e-12
        assert float((fast[1][name] - grad).abs().max()) / scale < max(tol * 4, 1e-3), name
    for a, b in zip(plain[2], fast[2], strict=True):
        np.testing.assert_allclose(b, a, atol=tol * 2, rtol=tol * 2)
