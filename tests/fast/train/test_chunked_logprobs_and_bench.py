"""Chunked lm_head logprobs equal full-logits logprobs (values and gradients), and bench/train_throughput.py's
two sides (our backend, a plain torch/PEFT loop) compute the same losses in --small mode."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.errors import UserError
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import Datum

BENCH = Path(__file__).resolve().parents[3] / "bench" / "train_throughput.py"


def _batch() -> list[Datum]:
    rng = np.random.default_rng(5)
    data = []
    for n in (6, 11, 3):
        tokens = rng.integers(0, 1024, n + 1).astype(np.int64)
        weights = rng.uniform(0, 1, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def _logprobs_and_grads(model_dir: Path, **options) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    backend = TransformersBackend(str(model_dir), train_mode="full", **options)
    out = backend.forward_backward("full", _batch(), "cross_entropy", {})
    return out.logprobs, {n: p.grad.clone() for n, p in backend.named_trainable_parameters("full")}


@pytest.mark.parametrize("checkpoint", [True, False])
def test_chunks_that_split_datums_equal_full_logits(tiny_model_dir: Path, checkpoint: bool) -> None:
    ref_lp, ref_grads = _logprobs_and_grads(tiny_model_dir, logprob_chunk_tokens=0)
    lp, grads = _logprobs_and_grads(
        tiny_model_dir, logprob_chunk_tokens=4, checkpoint_logprob_chunks=checkpoint
    )
    for a, b in zip(ref_lp, lp, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)


def test_negative_chunk_size_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(UserError, match="logprob_chunk_tokens"):
        TransformersBackend(str(tiny_model_dir), train_mode="full", logprob_chunk_tokens=-1)


def test_bench_small_sides_compute_the_same_losses() -> None:
    spec = importlib.util.spec_from_file_location("miles_bench_train_throughput", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    results = bench.main(["--small", "--steps", "2", "--warmup", "1"])
    for mode in ("full", "lora"):
        by_variant = {r.variant: r for r in results if r.mode == mode}
        plain, ours = by_variant["plain"], by_variant["ours"]
        assert len(plain.losses) == len(ours.losses) == 3
        np.testing.assert_allclose(ours.losses, plain.losses, rtol=1e-5)
        assert plain.losses[-1] < plain.losses[0], "the steps should lower the loss"
        assert ours.tokens_per_s > 0 and ours.tps_ratio > 0
