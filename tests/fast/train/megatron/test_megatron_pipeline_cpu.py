"""The megatron backend at pipeline 2 on CPU: two gloo ranks, one stage each, on the tiny model with its
embedding tied to the output layer (the last stage keeps megatron's copy). Against the transformers backend
at fp32: logprobs and loss through megatron's 1F1B schedule over several micro-batches, the gradient norm
over both stages, the logprobs after one AdamW step, and the HF export (rank 0 receives the second stage's
tensors). The push source's buckets equal the export; save_state / load_state resumes bit-exactly.

megatron-core 0.16.1 asks for CUDA in a few places: each rank redirects those to the CPU as
tools/megatron_cpu_check.py does. Skips without the gpu extra (CI has none)."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import pick_master_port
from miles.types import AdamParams, Datum
from tests.fast.train.megatron.ranks import join_gloo, running

ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
MICRO_BATCH_TOKENS = 24  # the batch below runs as 3 micro-batches: the schedule's warm-up, 1F1B and drain
BUCKET_BYTES = 24 * 1024  # some push buckets cut a fused tensor


def _batch(vocab: int) -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for n in (5, 9, 7, 12):
        tokens = rng.integers(0, vocab, n + 1)
        weights = rng.uniform(0, 1, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


def _steps(backend: Any, data: list[Datum]) -> dict[str, Any]:
    first = backend.forward_backward("full", data, "cross_entropy", {})
    norm = backend.optim_step("full", ADAM)["grad_norm:mean"]
    after = backend.forward_backward("full", data, "cross_entropy", {}, forward_only=True)
    return {
        "logprobs": first.logprobs,
        "loss": first.metrics["loss:sum"],
        "norm": norm,
        "after": after.logprobs,
    }


def _pushed(backend: Any) -> dict[str, torch.Tensor]:
    """Every bucket through the push source, as the sender's Broadcast would gather them."""
    import torch.distributed as dist

    from miles.utils.buckets import plan_buckets

    source = backend.push_source()
    plan: list[Any] = [plan_buckets(source.metas(), BUCKET_BYTES) if source.role == "sender" else None]
    dist.broadcast_object_list(plan, src=0)
    pushed: dict[str, torch.Tensor] = {}
    for bucket in plan[0]:
        names = [meta.name for meta in bucket]
        tensors = source.gather_bucket(names)
        if tensors is not None:
            pushed.update((n, t.clone()) for n, t in zip(names, tensors, strict=True))  # stage 0's are live
    return pushed


def _rank(rank: int, port: int, model_dir: str, out: str, results: Any) -> None:

    from miles.train.backends.megatron_backend import MegatronBackend
    from miles.train.dist import DistContext
    from miles.train.megatron.cpu import run_on_cpu

    try:
        run_on_cpu()
        join_gloo(rank, 2, port)
        backend = MegatronBackend(
            model_dir, train_mode="full", device="cpu", dtype=torch.float32, dist=DistContext(rank, 2),
            parallel={"pipeline": 2}, max_tokens_per_micro_batch=MICRO_BATCH_TOKENS,
        )  # fmt: skip
        data = _batch(backend.vocab_size)
        got = _steps(backend, data)
        backend.export_hf_weights(Path(out) / "export")
        pushed = _pushed(backend)
        backend.save_state("full", Path(out) / "state", with_optimizer=True)
        second = _steps(backend, data)["after"]
        backend.load_state("full", Path(out) / "state", with_optimizer=True)
        resumed = _steps(backend, data)["after"]
        exported = load_file(str(next((Path(out) / "export").glob("*.safetensors")))) if rank == 0 else {}
        got["push_equals_export"] = pushed.keys() == exported.keys() and all(
            torch.equal(pushed[n], exported[n]) for n in exported
        )
        got["resumed_exactly"] = all(np.array_equal(a, b) for a, b in zip(second, resumed, strict=True))
        results.put((rank, got))
    except BaseException as exc:
        results.put((rank, {"error": repr(exc)}))
        raise


@pytest.fixture
def tied_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    weights = load_file(str(tied / "model.safetensors"))
    del weights["lm_head.weight"]  # the output layer is the embedding
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    return tied


def test_pipeline_2_matches_the_transformers_backend_and_exports_pushes_and_resumes(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    from miles.train.backends.transformers_backend import TransformersBackend

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    args = (port, str(tied_model_dir), str(tmp_path / "out"), results)
    ranks = [ctx.Process(target=_rank, args=(r, *args)) for r in (0, 1)]
    with running(ranks):
        outcome = dict(results.get(timeout=240) for _ in ranks)
    assert all("error" not in r for r in outcome.values()), outcome
    got = outcome[0]
    ref = TransformersBackend(str(tied_model_dir), train_mode="full", device="cpu", dtype=torch.float32)
    want = _steps(ref, _batch(ref.vocab_size))
    for ours, theirs in ((got["logprobs"], want["logprobs"]), (got["after"], want["after"])):
        assert max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
    exported = load_file(str(next((tmp_path / "out" / "export").glob("*.safetensors"))))
    reference = dict(ref.iter_hf_weights())
    assert set(exported) == set(reference) - {"lm_head.weight"}  # tied: the embedding is the output layer
    # after one AdamW step of lr 1e-2: the tied embedding sums its two gradients in another order than the
    # transformers backend, and Adam turns the last bits of a tiny gradient into up to ~1e-6 of weight (a
    # wrong or misplaced tensor is off by far more)
    worst = {n: float((exported[n] - reference[n]).abs().max()) for n in exported}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert got["push_equals_export"]
    assert got["resumed_exactly"]
