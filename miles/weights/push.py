"""Driver side of the weight push; every push runs inside the InferenceController's update bracket.

Full weights (docs/weights.md "Push protocol"):
  Describe (trainer) -> plan buckets -> pause -> flush -> begin_weight_update -> group join (trainer
  Join || engines' init_weights_update_group, overlapping) -> per bucket: engines' POSTs || trainer
  Broadcast -> destroy group -> update_weight_version -> end_weight_update -> continue_generation.
Adapters: trainer export_adapter onto the shared filesystem -> engines unload (if loaded) + load.

On failure or cancellation the engine side is cleaned up best-effort (trainer leaves the group, engines
destroy it, close their session and continue) within `cleanup_timeout_s`, then the bracket aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.controller import InferenceController, WeightUpdate
from miles.train.commands import TrainerClient
from miles.weights.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets
from miles.weights.sender import Broadcast, Close, Describe, GroupFailure, GroupSpec, Join

logger = logging.getLogger(__name__)


class WeightPushError(RuntimeError):
    """The push failed outside the trainer (an engine, the weight-update group); the trainer is fine."""


async def _send(trainer: TrainerClient, step: Join | Broadcast) -> int:
    result = await trainer.run(step)
    if isinstance(result, GroupFailure):
        raise WeightPushError(f"weight push aborted: {result.message} (group {result.group_name})")
    return result


@dataclass(frozen=True)
class PushConfig:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    flattened: bool = True  # one broadcast per bucket (load_format="flattened_bucket")
    backend: str = "gloo"  # gloo on CPU, nccl on GPUs: same code path
    group_timeout_s: float = 600.0
    pause_mode: str = "retract"
    abort_on_version_update: bool = True
    cleanup_timeout_s: float = 30.0
    wait_for_engines_s: float = 600.0
    # Test hook: idle seconds between buckets (the keep-alive drill: a 5 s gap must not break the push).
    bucket_gap_s: float = 0.0


@dataclass
class PushReport:
    version: int
    buckets: int
    bytes: int
    engines: int
    # wall seconds: "prepare" (describe, pause, flush, begin, group join), "buckets", "finish" (version,
    # end, continue, group teardown)
    seconds: dict[str, float] = field(default_factory=dict)


BucketHook = Callable[[int], Awaitable[None]]


async def push_full_weights(
    controller: InferenceController,
    trainer: TrainerClient,
    config: PushConfig | None = None,
    *,
    on_bucket_in_flight: BucketHook | None = None,
) -> PushReport:
    """Push the trainer's current full weights to every serving engine; they become READY on success.

    `on_bucket_in_flight(k)` (tests) is awaited while bucket k's POSTs and broadcast are in flight.
    """
    config = config or PushConfig()
    marks = {"start": time.perf_counter()}
    async with controller.weight_update(wait_timeout_s=config.wait_for_engines_s) as update:
        info = await trainer.run(Describe())
        buckets = plan_buckets(info.tensors, config.bucket_bytes, flattened=config.flattened)
        group = GroupSpec(
            master_address=info.master_address,
            master_port=info.master_port,
            world_size=1 + sum(cell.gpus for cell in update.engines),
            group_name=f"miles-push-v{update.version}-{uuid.uuid4().hex[:8]}",
            backend=config.backend,
            timeout_s=config.group_timeout_s,
        )
        async with _engine_session(update, trainer, group, config):
            marks["joined"] = time.perf_counter()
            sent = 0
            for index, bucket in enumerate(buckets):
                if index and config.bucket_gap_s:
                    await asyncio.sleep(config.bucket_gap_s)
                sent += await _push_bucket(
                    update.clients, trainer, group, index, bucket, config, on_bucket_in_flight
                )
            marks["sent"] = time.perf_counter()
        marks["done"] = time.perf_counter()
        logger.info(
            "pushed %d bytes in %d buckets to %d engines (v%d)",
            sent,
            len(buckets),
            len(update.engines),
            update.version,
        )
        seconds = {
            "prepare": marks["joined"] - marks["start"],
            "buckets": marks["sent"] - marks["joined"],
            "finish": marks["done"] - marks["sent"],
        }
        return PushReport(update.version, len(buckets), sent, len(update.engines), seconds)


@contextlib.asynccontextmanager
async def _engine_session(
    update: WeightUpdate, trainer: TrainerClient, group: GroupSpec, config: PushConfig
) -> AsyncIterator[None]:
    clients = update.clients
    try:
        await _all(c.pause_generation(config.pause_mode) for c in clients)
        await _all(c.flush_cache() for c in clients)
        await _all(c.begin_weight_update() for c in clients)
        await _join_group(clients, update, trainer, group)
        yield
        # Every member leaves at once: an NCCL communicator's shutdown waits for its peers' shutdown (gloo's
        # does not), so the trainer's Close waiting for the engines' destroy, or the reverse, never ends.
        leaves = [trainer.run(Close(group.group_name))]
        await _all([*leaves, *(c.destroy_weights_update_group(group.group_name) for c in clients)])
        version = str(update.version)
        await _all(c.update_weight_version(version, config.abort_on_version_update) for c in clients)
        await _all(c.end_weight_update() for c in clients)
        await _all(c.continue_generation() for c in clients)
    except BaseException:
        await _cleanup_after_failure(clients, trainer, group, config.cleanup_timeout_s)
        raise


async def _join_group(
    clients: Sequence[SGLangApiClient], update: WeightUpdate, trainer: TrainerClient, group: GroupSpec
) -> None:
    """Trainer rank 0 and every engine join at once: each side blocks until all have joined."""
    offsets, cursor = [], 1
    for cell in update.engines:
        offsets.append(cursor)
        cursor += cell.gpus
    joins = [
        client.init_weights_update_group(
            master_address=group.master_address,
            master_port=group.master_port,
            rank_offset=offset,
            world_size=group.world_size,
            group_name=group.group_name,
            backend=group.backend,
        )
        for client, offset in zip(clients, offsets, strict=True)
    ]
    await _all([_send(trainer, Join(group)), *joins])


async def _push_bucket(
    clients: Sequence[SGLangApiClient],
    trainer: TrainerClient,
    group: GroupSpec,
    index: int,
    bucket: list[TensorMeta],
    config: PushConfig,
    on_bucket_in_flight: BucketHook | None,
) -> int:
    names = tuple(m.name for m in bucket)
    receives = [
        client.update_weights_from_distributed(
            names=list(names),
            dtypes=[m.dtype for m in bucket],
            shapes=[list(m.shape) for m in bucket],
            group_name=group.group_name,
            flush_cache=False,
            load_format="flattened_bucket" if config.flattened else None,
        )
        for client in clients
    ]
    send = _send(trainer, Broadcast(group.group_name, index, names, config.flattened))
    during = (lambda: on_bucket_in_flight(index)) if on_bucket_in_flight else None
    results = await _all([send, *receives], during=during)
    return results[0]


async def _cleanup_after_failure(
    clients: Sequence[SGLangApiClient], trainer: TrainerClient, group: GroupSpec, timeout_s: float
) -> None:
    """Best effort, bounded: the trainer leaves the group first (engines blocked in a receive then fail
    fast), then engines drop the group, close the update session and resume generation."""

    async def steps() -> None:
        with contextlib.suppress(Exception):
            await trainer.run(Close(group.group_name))
        await asyncio.gather(
            *(c.destroy_weights_update_group(group.group_name) for c in clients), return_exceptions=True
        )
        await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
        await asyncio.gather(*(c.continue_generation() for c in clients), return_exceptions=True)

    try:
        await asyncio.wait_for(steps(), timeout_s)
    except Exception as exc:  # never mask the push's own error
        logger.warning("cleanup after a failed push did not finish: %s", exc)


async def _all(awaitables: Any, *, during: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise that failure (unwrapped).

    `during` is awaited once everything has been started (a test hook)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        if during is not None:
            await during()
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ----- adapters ------------------------------------------------------------------------------------------


async def publish_adapter_dir(
    controller: InferenceController, *, lora_name: str, path: str | Path, wait_for_engines_s: float = 600.0
) -> None:
    """(Re)load an already exported PEFT directory on every serving engine as `lora_name`."""
    resolved = str(Path(path).resolve())
    if not Path(resolved).is_dir():
        raise ValueError(f"adapter directory {resolved!r} does not exist; export the adapter first")
    async with controller.weight_update(wait_timeout_s=wait_for_engines_s, base_weights=False) as update:
        await _all(_reload_adapter(client, lora_name, resolved) for client in update.clients)
        controller.published_adapters[lora_name] = resolved


async def unload_adapter(controller: InferenceController, *, lora_name: str) -> None:
    async with controller.weight_update(base_weights=False) as update:
        await _all(_unload_if_loaded(client, lora_name) for client in update.clients)
        controller.published_adapters.pop(lora_name, None)


async def reload_published_adapters(controller: InferenceController) -> None:
    """Refresher for LoRA deployments: a respawned engine gets every published adapter again."""
    async with controller.weight_update(base_weights=False) as update:
        for name, path in sorted(controller.published_adapters.items()):
            if not Path(path).is_dir():  # its checkpoint was deleted: nothing can sample from it any more
                logger.warning("adapter %s: %s is gone; not reloading it", name, path)
                controller.published_adapters.pop(name, None)
                continue
            await _all(_reload_adapter(client, name, path) for client in update.clients)


async def _reload_adapter(client: SGLangApiClient, name: str, path: str) -> None:
    await _unload_if_loaded(client, name)
    await client.load_lora_adapter(name, path)


async def _unload_if_loaded(client: SGLangApiClient, name: str) -> None:
    from miles.engines.errors import EngineRefused

    with contextlib.suppress(EngineRefused):  # "not loaded": nothing to unload
        await client.unload_lora_adapter(name)
