"""After a delta push or a recording one: do the engines hold exactly the trainer's image of them?

The trainer digests each tensor of its image (`DigestImage`) while every engine digests its parameters
(SGLang's `/weights_checker` route with our `miles_digest` action, which SGLang itself refuses), and the
two are compared tensor by tensor. After a delta push a difference is an error (`DeltaMismatch`: the push
aborts and the caller pushes in full); after a recording push it means these engines cannot take deltas
(docs/weights.md "Delta push"). Also the delta push's numbers in the metrics and the event log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.contract import events
from miles.engines.errors import EngineError
from miles.engines.sglang_client import DIGEST_ACTION
from miles.observability.metrics import job_metrics
from miles.train.commands import TrainerClient
from miles.weights.delta_image import DeltaMode
from miles.weights.sender import DigestImage, GroupFailure

logger = logging.getLogger(__name__)


class DeltaMismatch(RuntimeError):
    """After a delta push an engine's digest of some tensor differed from the trainer's image."""

    def __init__(self, version: int, engine: str, tensors: list[str]) -> None:
        self.version, self.engine, self.tensors = version, engine, tensors
        super().__init__(
            f"delta push v{version}: engine {engine} differs from the trainer's image in {len(tensors)} "
            f"tensors ({', '.join(tensors[:5])})"
        )


@dataclass(frozen=True)
class Verdict:
    verified: bool  # every engine holds the trainer's image: the next push may send deltas
    refusal: str | None = None  # why these engines cannot take deltas at all (learned once)


async def check_engines(
    trainer: TrainerClient, engines: Sequence[Any], group_name: str, mode: DeltaMode, version: int
) -> Verdict:
    """`engines`: the push's cells (`.name`, `.client`). Raises DeltaMismatch (or what failed) after a
    delta push; after a recording push never raises: the push itself went through."""
    asked = [
        trainer.run(DigestImage(group_name)),
        *(c.client.weights_checker(DIGEST_ACTION) for c in engines),
    ]
    image, *answers = await asyncio.gather(*asked, return_exceptions=True)
    if isinstance(image, GroupFailure):
        image = RuntimeError(f"the trainer holds no image to check the push with: {image.message}")
    if isinstance(image, BaseException):
        return _unchecked(mode, image)
    for cell, answer in zip(engines, answers, strict=True):
        if isinstance(answer, EngineError) and mode == "record":
            return Verdict(False, f"engine {cell.name} does not answer the digest ({answer})")
        if isinstance(answer, BaseException):
            return _unchecked(mode, answer)
        differ = image_differences(image, answer)
        if differ and mode == "send":
            raise DeltaMismatch(version, cell.name, differ)
        if differ:
            return Verdict(
                False,
                f"engine {cell.name} holds {len(differ)} tensors otherwise than a full push sent them "
                f"({', '.join(differ[:3])}): another dtype or layout",
            )
    return Verdict(True)


def _unchecked(mode: DeltaMode, error: BaseException) -> Verdict:
    if mode == "send":
        raise error
    logger.warning("the recorded image could not be checked (%s); the next push records again", error)
    return Verdict(False)


def image_differences(image: dict[str, str], answer: Any) -> list[str]:
    """The tensors whose digest in an engine's /weights_checker answer differs from (or lacks) the
    trainer's, in the trainer's order (pure)."""
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    held: dict[str, str] = {}
    for rank in ranks or []:
        held.update(rank.get("checksums") or {})
    return [name for name, value in image.items() if held.get(name) != value]


def observe_delta(report: Any) -> None:
    """A push's delta numbers (`report`: a PushReport of a push with deltas on) in the metrics and the
    event log."""
    metrics = job_metrics()
    metrics.push_dense_bytes.labels(report.mode).inc(report.dense_bytes)
    if report.fallback is not None:
        metrics.push_delta_fallbacks.labels(report.fallback).inc()
    forms: dict[str, int] = {}
    for bucket in report.bucket_timings:
        forms[bucket.form] = forms.get(bucket.form, 0) + 1
    if report.mode == "send":
        for form, count in forms.items():
            metrics.push_delta_buckets.labels(form).inc(count)
        metrics.push_delta_density.set(report.density or 0.0)
    events.record(
        "push_delta",
        version=report.version,
        mode=report.mode,
        bytes=report.bytes,
        dense_bytes=report.dense_bytes,
        density=None if report.density is None else round(report.density, 6),
        forms=forms,
        verified=report.verified,
        fallback=report.fallback,
        encode_seconds=round(sum(b.encode_s for b in report.bucket_timings), 4),
        verify_seconds=round(report.steps.get("verify", 0.0), 4),
    )


def observe_mismatch(exc: DeltaMismatch) -> None:
    logger.error("%s; pushing the full weights", exc)
    job_metrics().push_digest_mismatches.inc()
    events.record("push_digest_mismatch", version=exc.version, engine=exc.engine, tensors=exc.tensors[:20])
