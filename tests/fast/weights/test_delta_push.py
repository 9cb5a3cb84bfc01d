"""The delta push through the real driver, sender and CPU engine (bench/push_nccl.py's harness: a trainer
process and an in-process engine over gloo): a push after a full one sends only what changed and leaves
the engine bit-identical to the trainer, checked by digest; a corrupted delta is caught by the digest and
pushed again in full; a malformed one is refused and the next push is full; engines that cannot answer
the digest (SGLang) get full pushes. docs/weights.md "Delta push"."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import push_nccl

from miles.engines.cpu import engine as engine_module
from miles.engines.errors import EngineRefused
from miles.observability.metrics import job_metrics
from miles.utils import delta
from miles.weights.push import PushConfig, PushReport, drop_kept_group, push_full_weights

TOKENS = np.arange(1, 34, dtype=np.int64)
# deltas stay on however they compare with full pushes here (DeltaPace is tested on its own)
CONFIG = PushConfig(bucket_bytes=64 * 1024, backend="gloo", delta=True, delta_pace=False)


def _metric(name: str, **labels: str) -> float:
    return job_metrics().registry.get_sample_value(name, labels) or 0.0


class _Harness:
    def __init__(self, model_dir: Path, client_cls: type = push_nccl.DirectEngineClient) -> None:
        self.model_dir = model_dir
        self.client_cls = client_cls

    async def __aenter__(self) -> _Harness:
        # the engine holds what the trainer sends (bf16): a delta applies to the bytes as sent
        self.engine = push_nccl.Engine(str(self.model_dir), dtype="bfloat16")
        await self.engine.load()
        await self.engine.wait_loaded()
        self.trainer = push_nccl.TrainerProcess(self.model_dir, "bfloat16", None)
        self.client = self.client_cls(self.engine)
        self.controller = push_nccl.InferenceController([push_nccl.DirectEngineCell(self.client)])
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await drop_kept_group(self.controller, self.trainer)
        finally:
            self.trainer.stop()
            await self.engine.close()

    async def step(self) -> None:
        await asyncio.to_thread(self.trainer.request, "step", TOKENS)

    async def push(self) -> PushReport:
        return await push_full_weights(self.controller, self.trainer, CONFIG)

    async def differing(self) -> list[str]:
        """Tensors whose bytes differ between the trainer and the engine (exact: compared as bytes)."""
        theirs = await asyncio.to_thread(self.trainer.request, "weight_bytes")
        params = self.engine.model().params
        return [n for n, b in theirs.items() if not torch.equal(params[n].data.view(torch.uint8), b)]


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    push_nccl.write_model(tmp_path, "tiny", torch.bfloat16, "cpu")
    return tmp_path


async def _deltas_are_exact(model_dir: Path) -> None:
    sent_before = _metric("miles_push_dense_bytes_total", mode="send")
    async with _Harness(model_dir) as h:
        first = await h.push()
        assert (first.mode, first.verified, first.bytes) == ("record", True, first.dense_bytes)
        assert await h.differing() == []
        for _ in range(2):
            await h.step()
            assert await h.differing(), "the step changed the trainer's weights"
            report = await h.push()
            assert report.reused_group and report.mode == "send" and report.verified
            assert await h.differing() == [], "the engine holds exactly the trainer's weights"
            assert report.bytes < report.dense_bytes, (report.bytes, report.dense_bytes)
            assert 0.0 < (report.density or 0.0) < 1.0
            assert {b.form for b in report.bucket_timings} <= set(delta.KIND_CODES)
        assert _metric("miles_push_dense_bytes_total", mode="send") - sent_before == 2 * report.dense_bytes
        assert _metric("miles_push_delta_density") == pytest.approx(report.density)
        # other buckets: the image is of the old ones, so this push records anew instead of failing
        await h.step()
        replanned = await push_full_weights(h.controller, h.trainer, replace(CONFIG, bucket_bytes=32 * 1024))
        assert replanned.reused_group and replanned.mode == "record" and replanned.verified
        assert replanned.buckets > report.buckets and await h.differing() == []


@pytest.mark.timeout(180)
def test_delta_pushes_send_less_and_leave_the_engine_bit_identical(model_dir: Path) -> None:
    asyncio.run(_deltas_are_exact(model_dir))


async def _corruption_is_caught(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    apply = delta.apply_bucket
    mismatches = _metric("miles_push_digest_mismatches_total")
    async with _Harness(model_dir) as h:
        await h.push()
        await h.step()

        def corrupted_on_the_way(target: torch.Tensor, header: torch.Tensor, payload: torch.Tensor) -> None:
            apply(target, header, payload)
            target[0] ^= 1  # one bit of one value, as a flipped bit in flight or a faulty apply leaves it
            monkeypatch.setattr(engine_module.delta, "apply_bucket", apply)  # once

        monkeypatch.setattr(engine_module.delta, "apply_bucket", corrupted_on_the_way)
        report = await h.push()
        assert _metric("miles_push_digest_mismatches_total") == mismatches + 1
        assert report.mode == "record" and report.verified and not report.reused_group, (
            "the mismatch made the push send the full weights over a fresh group"
        )
        assert await h.differing() == []

        def malformed(target: torch.Tensor, header: torch.Tensor, payload: torch.Tensor) -> None:
            header = header.clone()
            header[2] += 8  # the payload size the header claims
            apply(target, header, payload)

        await h.step()
        monkeypatch.setattr(engine_module.delta, "apply_bucket", malformed)
        with pytest.raises(EngineRefused, match="delta bucket refused"):
            await h.push()
        monkeypatch.setattr(engine_module.delta, "apply_bucket", apply)
        after = await h.push()
        assert after.mode == "record" and after.verified and not after.reused_group
        assert await h.differing() == []


@pytest.mark.timeout(180)
def test_a_corrupted_delta_is_pushed_again_in_full_and_a_malformed_one_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_corruption_is_caught(model_dir, monkeypatch))


class _SGLangLikeClient(push_nccl.DirectEngineClient):
    async def weights_checker(self, action: str = "checksum") -> dict:
        if action != "checksum":  # SGLang's WeightChecker: `raise Exception(f"Unsupported {action=}")`
            raise EngineRefused(f"/weights_checker failed (400): Unsupported action={action!r}")
        return await super().weights_checker(action)


async def _refusing_engines_get_full_pushes(model_dir: Path) -> None:
    refused = _metric("miles_push_delta_fallbacks_total", reason="engines_refuse")
    no_image = _metric("miles_push_delta_fallbacks_total", reason="no_image")
    async with _Harness(model_dir, _SGLangLikeClient) as h:
        first = await h.push()
        assert first.mode == "record" and not first.verified
        off = h.controller.delta_off
        assert off.reason == "engines_refuse" and "does not answer the digest" in off.detail
        await h.step()
        second = await h.push()
        assert second.reused_group and second.mode == "off" and second.bytes == second.dense_bytes
        assert await h.differing() == []
        assert _metric("miles_push_delta_fallbacks_total", reason="no_image") == no_image + 1
        assert _metric("miles_push_delta_fallbacks_total", reason="engines_refuse") == refused + 1


@pytest.mark.timeout(180)
def test_engines_that_cannot_answer_the_digest_get_full_pushes(model_dir: Path) -> None:
    asyncio.run(_refusing_engines_get_full_pushes(model_dir))
