"""Driver side of the colocated weight push (docs/colocation.md): trainer rank i shares its weights with
engine i, which sits on the same GPU, through SGLang's `/update_weights_from_tensor`.

Inside the InferenceController's update bracket, like the distributed push (miles.weights.push), with the
same lock, version and readiness rules:
  trainer ShareWeightBuckets (every rank) || each engine: begin_weight_update
  -> each engine POSTs all its buckets at once, its own rank's payloads, each carrying the version and
     flush_cache (the engine loads them one after another; their round trips overlap)
  -> each engine: end_weight_update || the trainer frees its flattened buckets' copies (memory-tight jobs:
     back to the device)
  -> each engine: `then` (e.g. resume its KV cache).
No pause: a colocated engine takes a push only while it is not routed to (released, or just resumed), and
no separate version or flush call: an idle engine needs neither abort nor wait, so each would be one more
round trip per push. The trainer keeps the shared tensors until its next ShareWeightBuckets replaces them.
On failure or cancellation each engine's session is closed and the trainer lets its tensors go, best
effort and bounded, then the bracket aborts: no engine is marked ready, the lock is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.controller import InferenceController
from miles.train.commands import TrainerClient
from miles.utils.step_clock import StepClock
from miles.weights.ipc_sender import ReleaseSharedWeights, SharedBuckets, ShareWeightBuckets
from miles.weights.push import (
    BucketTiming,
    PushConfig,
    PushReport,
    WeightPushError,
    all_or_none,
    log_pushed,
    metered_push,
    observe_push,
)

logger = logging.getLogger(__name__)

EngineStep = Callable[[Any], Awaitable[None]]  # an engine cell -> a call on it


class RunsOnEveryRank(TrainerClient, Protocol):
    """A TrainerClient that also answers every rank's result (miles.train.controller.TrainerController)."""

    async def run_all(self, command: Any) -> list[Any]: ...


async def push_over_ipc(
    controller: InferenceController,
    trainer: RunsOnEveryRank,
    config: PushConfig,
    *,
    then: EngineStep | None = None,
) -> PushReport:
    """Push every trainer rank's weights into the engine on its GPU; they become READY on success.
    `then(cell)` runs on each engine after its session ended, inside the bracket (resume the KV cache)."""
    with metered_push("ipc"):
        report = await _push(controller, trainer, config, then)
    observe_push("ipc", report, sum(report.seconds.values()))  # its three phases; the others lie inside
    return report


async def _push(
    controller: InferenceController, trainer: RunsOnEveryRank, config: PushConfig, then: EngineStep | None
) -> PushReport:
    clock = StepClock()
    async with controller.weight_update(wait_timeout_s=config.wait_for_engines_s) as update:
        clients = update.clients
        try:
            with clock("prepare"):
                shared, _ = await all_or_none(
                    [
                        clock.timed(
                            "describe",
                            trainer.run_all(ShareWeightBuckets(config.bucket_bytes, config.flattened)),
                        ),
                        clock.timed("quiesce", all_or_none(c.begin_weight_update() for c in clients)),
                    ]
                )
            payloads = _payloads_per_engine(shared, update.engines)
            clock.steps.update(_trainer_steps(shared))
            version = str(update.version)
            timings = await _send_buckets(clients, payloads, shared[0], version, clock)
            with clock("release"):
                await _finish(update.engines, trainer, shared, then, config.ipc_copies_to_device)
        except BaseException:
            await _cleanup(clients, trainer, config)
            raise
        report = PushReport(
            update.version,
            len(shared[0].payloads),
            sum(shared[0].bytes),
            len(update.engines),
            clock.steps,
            timings,
            group="ipc",
        )
        log_pushed(report, " over IPC", clock.now())
        return report


Payload = tuple[str, str | None]  # one bucket's serialized_named_tensors entry and its load_format


def _payloads_per_engine(shared: Sequence[SharedBuckets], engines: Sequence[Any]) -> list[list[Payload]]:
    """Engine cell i sits on trainer rank i's GPU (the colocated layout, miles.runtime.layout): its
    buckets are rank i's, in rank i's formats (a rank short of memory sends a bucket unflattened). A
    respawned engine keeps its bundle, so the pairing holds."""
    failed = [f"rank {rank}: {s.error}" for rank, s in enumerate(shared) if s.error is not None]
    if failed:
        raise WeightPushError(f"the trainer could not share its weights over IPC: {'; '.join(failed)}")
    if len({len(s.payloads) for s in shared}) != 1:
        raise WeightPushError("trainer ranks planned different buckets; their weights differ")
    out = []
    for cell in engines:
        if cell.index >= len(shared):
            raise WeightPushError(
                f"{cell.name} has no trainer rank on its GPU ({len(shared)} ranks): not a colocated layout"
            )
        mine = shared[cell.index]
        out.append(list(zip(mine.payloads, mine.load_formats, strict=True)))
    return out


def _trainer_steps(shared: Sequence[SharedBuckets]) -> dict[str, float]:
    """The slowest rank's seconds in each part of its share (SharedBuckets.seconds), as push steps
    `trainer_plan`, `trainer_pack`, `trainer_handles`: what of `describe` was the trainer's own work."""
    names = {name for rank in shared for name in rank.seconds}
    return {f"trainer_{n}": max(rank.seconds.get(n, 0.0) for rank in shared) for n in sorted(names)}


async def _send_buckets(
    clients: Sequence[SGLangApiClient],
    payloads: list[list[Payload]],
    sizes: SharedBuckets,
    version: str,
    clock: StepClock,
) -> list[BucketTiming]:
    """Every bucket to every engine at once; one timing per bucket (all of them span the same calls)."""

    async def engine_takes(client: SGLangApiClient, mine: list[Payload]) -> None:
        await all_or_none(
            client.update_weights_from_tensor(
                [payload], load_format=load_format, flush_cache=True, weight_version=version
            )
            for payload, load_format in mine
        )

    with clock("buckets"):
        start = clock.now()
        await all_or_none(engine_takes(client, mine) for client, mine in zip(clients, payloads, strict=True))
        end = clock.now()
    return [BucketTiming(nbytes, start, 0.0, end - start, end, end) for nbytes in sizes.bytes]


async def _finish(
    engines: Sequence[Any],
    trainer: RunsOnEveryRank,
    shared: Sequence[SharedBuckets],
    then: EngineStep | None,
    to_device: bool,
) -> None:
    """Every engine's session ends; the trainer frees its bucket copies (flattened buckets) at the same
    time (into its allocator's cache, where its next step finds them; `to_device`: back to the device),
    before any engine takes its KV cache back. Then `then`."""
    copies = any(form is not None for ranks in shared for form in ranks.load_formats)
    ends = [cell.client.end_weight_update() for cell in engines]
    await all_or_none([*ends, trainer.run_all(ReleaseSharedWeights(to_device))] if copies else ends)
    if then is not None:
        await all_or_none(then(cell) for cell in engines)


async def _cleanup(clients: Sequence[SGLangApiClient], trainer: RunsOnEveryRank, config: PushConfig) -> None:
    """Best effort, bounded: each engine's session closed, the trainer's shared tensors let go."""

    async def engine_ends(client: SGLangApiClient) -> None:
        with contextlib.suppress(Exception):
            await client.end_weight_update()

    async def trainer_releases() -> None:
        with contextlib.suppress(Exception):
            await trainer.run_all(ReleaseSharedWeights(config.ipc_copies_to_device))

    try:
        await asyncio.wait_for(
            asyncio.gather(trainer_releases(), *(engine_ends(c) for c in clients)), config.cleanup_timeout_s
        )
    except Exception as exc:  # never mask the push's own error
        logger.warning("cleanup after a failed IPC push did not finish: %s", exc)
