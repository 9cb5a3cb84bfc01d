"""Driver side of the weight push; every push runs inside the InferenceController's update bracket.

Full weights (docs/weights.md "Push protocol"):
  Describe (trainer) || each engine: pause -> flush -> begin_weight_update; plan buckets -> group join
  (trainer Join || engines' init_weights_update_group, overlapping; only the trainer's Join when the
  group the last push kept joins the same processes) -> per bucket: engines' POSTs || trainer Broadcast
  -> trainer Close(keep) || each engine: update_weight_version -> end_weight_update -> continue_generation
  (with keep_group=False each side leaves the group first).
Adapters: trainer export_adapter onto the shared filesystem -> engines unload (if loaded) + load.

On failure or cancellation the engine side is cleaned up best-effort (trainer leaves the group, engines
destroy it, close their session and continue) within `cleanup_timeout_s`, then the bracket aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from miles.contract import events
from miles.engines.sglang_client import DELTA_LOAD_FORMAT, SGLangApiClient
from miles.observability.metrics import job_metrics
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController, WeightUpdate
from miles.train.commands import TrainerClient
from miles.types import TimedPart
from miles.utils.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets
from miles.utils.step_clock import StepClock
from miles.weights.delta_check import DeltaMismatch, check_engines, observe_delta, observe_mismatch
from miles.weights.delta_image import DeltaMode
from miles.weights.kept_group import (
    DeltaOff,
    DeltaPace,
    KeptGroup,
    MemberId,
    delta_mode,
    fallback_reason,
    layout_known,
    member_ids,
    reusable,
)
from miles.weights.sender import (
    Broadcast,
    Close,
    Describe,
    GroupFailure,
    GroupSpec,
    Join,
    SenderInfo,
    SentBucket,
    StaleLayout,
)

logger = logging.getLogger(__name__)


class WeightPushError(RuntimeError):
    """The push failed outside the trainer (an engine, the weight-update group); the trainer is fine."""


async def _send(trainer: TrainerClient, step: Join | Broadcast) -> Any:
    """The trainer's answer; a GroupFailure raises WeightPushError (a StaleLayout is returned)."""
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
    # Empty the engines' prefix cache before the buckets. An in-place update (IN_PLACE) keeps it: the
    # requests paused in place hold their KV cache, and SGLang refuses a flush while any request does.
    flush_cache: bool = True
    # Colocated, flattened: after the push the trainer empties its allocator's cache, so that the bucket
    # copies' memory goes back to the device before the engines resume their KV cache. Costs a cudaFree of
    # every cached block and the next step's allocations anew (measured: 48.6 ms of push and 55 ms of step
    # for the 0.6B on one H100), so only memory-tight jobs (colocate.trainer_offload set) ask for it.
    ipc_copies_to_device: bool = False
    cleanup_timeout_s: float = 30.0
    wait_for_engines_s: float = 600.0
    # Leave the group joined after a successful push, for the next push while its members are the same
    # processes (miles/weights/kept_group.py); False makes and destroys a group per push.
    keep_group: bool = True
    # Test hook: idle seconds between buckets (the keep-alive drill: a 5 s gap must not break the push).
    bucket_gap_s: float = 0.0
    # Send what changed since the last push over the kept group, checked by digest (docs/weights.md
    # "Delta push"); needs flattened buckets and engines that answer the digest (our CPU engine).
    delta: bool = False
    # Turn deltas off for the job after two delta pushes slower than the last full one (kept_group.
    # DeltaPace); False keeps them on (benches that measure exactly that).
    delta_pace: bool = True


@dataclass(frozen=True)
class BucketTiming:
    """One bucket, in seconds from the push's start (`start_s`, `trainer_done_s`, `end_s`) or spent."""

    bytes: int
    start_s: float  # the engines' POSTs and the trainer's Broadcast were issued
    pack_wait_s: float  # the trainer waited for this bucket's packing (0 when packed during the last one)
    wire_s: float  # the trainer's broadcast call
    trainer_done_s: float  # the Broadcast command's answer reached the driver
    end_s: float  # every engine answered: received, loaded, and replied over HTTP
    dense_bytes: int = 0  # what a full push of this bucket sends
    form: str = "full"  # a delta push: the form sent (dense, sparse, bitmask, bitmask_i8)
    changed: int | None = None  # a delta push: 16-bit words that changed
    encode_s: float = 0.0  # trainer: diffing against (or recording) the engines' image


# The steps a push times (`PushReport.steps`, wall seconds): "prepare" spans "describe" (the trainer's
# tensor list) and "quiesce" (every engine: pause -> flush -> begin), which run at the same time, and
# "join"; then "buckets"; then "release" (every engine: leave the group -> version -> end -> continue,
# with the trainer leaving too).
@dataclass
class PushReport:
    version: int
    buckets: int
    bytes: int
    engines: int
    steps: dict[str, float] = field(default_factory=dict)  # see "The steps a push times" above
    bucket_timings: list[BucketTiming] = field(default_factory=list)
    group: str = ""  # the weight-update group's name
    reused_group: bool = False  # the group an earlier push kept (no join, no set-up)
    mode: str = "off"  # DeltaMode: off, record (a full push keeping an image), send (a delta push)
    verified: bool = False  # the engines' digests equalled the trainer's image after the buckets
    fallback: str | None = None  # with deltas on, why this push sent in full (no_image, engines_refuse)

    @property
    def dense_bytes(self) -> int:
        """What a full push sends (== bytes unless this was a delta push)."""
        return sum(b.dense_bytes for b in self.bucket_timings) or self.bytes

    @property
    def density(self) -> float | None:
        """A delta push: the changed fraction of the 16-bit words sent."""
        if self.mode != "send" or not self.bucket_timings:
            return None
        words = sum(b.dense_bytes // 2 for b in self.bucket_timings)
        return sum(b.changed or 0 for b in self.bucket_timings) / max(words, 1)

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds of the three phases: prepare, buckets, finish."""
        return {
            "prepare": self.steps.get("prepare", 0.0),
            "buckets": self.steps.get("buckets", 0.0),
            "finish": self.steps.get("release", 0.0),
        }

    @property
    def gaps(self) -> list[float]:
        """Idle seconds between the end of bucket k and the start of bucket k+1 (the keep-alive race's
        signal: a connection idle for the engines' keep-alive can be closed under the next request)."""
        return [b.start_s - a.end_s for a, b in itertools.pairwise(self.bucket_timings)]

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def bucket_seconds(self) -> list[float]:
        return [b.end_s - b.start_s for b in self.bucket_timings]

    def breakdown(self) -> dict[str, float]:
        """Where the push's time went, summed over buckets (docs/weights.md "Where a push's time goes")."""
        timings = self.bucket_timings
        return {
            "prepare": self.seconds["prepare"],
            "describe": self.steps.get("describe", 0.0),
            "quiesce": self.steps.get("quiesce", 0.0),
            "group_join": self.steps.get("join", 0.0),
            "trainer_pack_wait": sum(b.pack_wait_s for b in timings),
            "wire": sum(b.wire_s for b in timings),
            "engines_after_broadcast": sum(b.end_s - b.trainer_done_s for b in timings),
            "between_buckets": sum(self.gaps),
            "finish": self.seconds["finish"],
        }


# runtime.push_update: "bracket" retracts running samples and aborts them at the version update, so no
# sample mixes two versions (the caller sees SampleAbortedError); "in_place" pauses them in place with their
# KV cache, keeps the cache, and lets them continue on the new weights, each token's version reported in the
# answer's weight_versions (SGLang 0.5.23's pause mode and spans; docs/weights.md "In-place updates").
BRACKET = PushConfig(pause_mode="retract", abort_on_version_update=True, flush_cache=True)
IN_PLACE = PushConfig(pause_mode="in_place", abort_on_version_update=False, flush_cache=False)


def update_mode(config: PushConfig, mode: str) -> PushConfig:
    """`config` with runtime.push_update's `mode` ("bracket" or "in_place") of treating running samples."""
    like = {"bracket": BRACKET, "in_place": IN_PLACE}[mode]
    return replace(
        config,
        pause_mode=like.pause_mode,
        abort_on_version_update=like.abort_on_version_update,
        flush_cache=like.flush_cache,
    )


def push_timeline(report: PushReport, started_s: float) -> list[TimedPart]:
    """The push for the session trace, from its wall-clock start: prepare, each bucket (engines' POSTs
    issued to every engine's answer) and the release, on one lane."""
    prepare = report.steps.get("prepare", 0.0)
    parts = [
        TimedPart("prepare", "push", started_s, prepare, {"version": report.version, "mode": report.mode})
    ]
    for index, bucket in enumerate(report.bucket_timings):
        args = {
            "bucket": index,
            "bytes": bucket.bytes,
            "form": bucket.form,
            "wire_s": round(bucket.wire_s, 6),
        }
        parts.append(
            TimedPart("bucket", "push", started_s + bucket.start_s, bucket.end_s - bucket.start_s, args)
        )
    if report.bucket_timings:
        released_at = started_s + report.bucket_timings[-1].end_s
        parts.append(TimedPart("release", "push", released_at, report.steps.get("release", 0.0)))
    return parts


def log_pushed(report: PushReport, how: str, seconds: float) -> None:
    """One log line per finished push; `how`: " over IPC" and the like, or ""."""
    logger.info(
        "pushed %d bytes in %d buckets%s to %d engines (v%d) in %.3f s",
        report.bytes,
        report.buckets,
        how,
        report.engines,
        report.version,
        seconds,
    )


def observe_push(kind: str, report: PushReport | None, seconds: float) -> None:
    """A finished push in the metrics and the event log (kind: "full" or "adapter")."""
    metrics = job_metrics()
    metrics.push_seconds.labels(kind).observe(seconds)
    fields: dict[str, Any] = {"push": kind, "seconds": round(seconds, 4)}
    if report is not None:
        metrics.push_bytes.labels(kind).inc(report.bytes)
        metrics.push_buckets.labels(kind).inc(report.buckets)
        metrics.push_max_gap.set(report.max_gap)
        for gap in report.gaps:
            metrics.push_gap.observe(gap)
        fields.update(
            version=report.version,
            buckets=report.buckets,
            bytes=report.bytes,
            engines=report.engines,
            gaps=[round(g, 4) for g in report.gaps],
            bucket_seconds=[round(b, 4) for b in report.bucket_seconds],
            steps={name: round(seconds, 4) for name, seconds in report.steps.items()},
        )
    events.record("push", **fields)


def observe_abort(kind: str, exc: BaseException, seconds: float) -> None:
    reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
    job_metrics().push_aborts.labels(kind, reason).inc()
    events.record("push_aborted", push=kind, reason=reason, error=str(exc)[:300], seconds=round(seconds, 4))


@contextlib.contextmanager
def metered_push(kind: str) -> Any:
    """Time a push; its abort (any exception or cancellation) is counted by the exception's type."""
    started = time.monotonic()
    try:
        yield
    except BaseException as exc:
        observe_abort(kind, exc, time.monotonic() - started)
        raise


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
    with metered_push("full"):
        try:
            report = await _push_full(controller, trainer, config, on_bucket_in_flight)
        except DeltaMismatch as exc:
            # The bracket aborted: no engine serves, the group and the image are gone. A fresh group's
            # push sends (and records) the full weights.
            observe_mismatch(exc)
            report = await _push_full(controller, trainer, config, on_bucket_in_flight)
    observe_push("full", report, sum(report.seconds.values()))
    return report


@dataclass
class _Session:
    """One push's group and plan once every member joined; `verified` is set when digests agreed."""

    group: GroupSpec
    buckets: list[list[TensorMeta]]
    reused: bool
    mode: DeltaMode
    fallback: str | None  # why a push with deltas on sends in full (kept_group.fallback_reason)
    verified: bool = False


async def _push_full(
    controller: InferenceController,
    trainer: TrainerClient,
    config: PushConfig,
    on_bucket_in_flight: BucketHook | None,
) -> PushReport:
    clock = StepClock()
    async with controller.weight_update(wait_timeout_s=config.wait_for_engines_s) as update:
        timings: list[BucketTiming] = []
        async with _engine_session(controller, update, trainer, config, clock) as session:
            group = session.group
            with clock("buckets"):
                for index, bucket in enumerate(session.buckets):
                    if index and config.bucket_gap_s:
                        await asyncio.sleep(config.bucket_gap_s)
                    timings.append(
                        await _push_bucket(
                            update.clients,
                            trainer,
                            session,
                            index,
                            bucket,
                            config,
                            clock,
                            on_bucket_in_flight,
                        )
                    )
            if session.mode != "off":
                with clock("verify"):
                    verdict = await check_engines(
                        trainer, update.engines, group.group_name, session.mode, update.version
                    )
                session.verified = verdict.verified
                if verdict.refusal is not None:
                    _deltas_off(controller, DeltaOff("engines_refuse", verdict.refusal))
        report = PushReport(
            update.version,
            len(session.buckets),
            sum(t.bytes for t in timings),
            len(update.engines),
            clock.steps,
            timings,
            group.group_name,
            session.reused,
            session.mode,
            session.verified,
            session.fallback,
        )
        log_pushed(report, " as deltas" if session.mode == "send" else "", clock.now())
        if config.delta:
            observe_delta(report)
            pace_deltas(controller, config, report.mode, clock.now())
        return report


def pace_deltas(controller: InferenceController, config: PushConfig, mode: str, seconds: float) -> None:
    """Deltas stay on only while they pay (kept_group.DeltaPace), unless the config keeps them on."""
    if not config.delta_pace:
        return
    pace = controller.delta_pace = controller.delta_pace or DeltaPace()
    if (off := pace.after(mode, seconds)) is not None:  # type: ignore[arg-type]
        _deltas_off(controller, off)


def _deltas_off(controller: InferenceController, off: DeltaOff) -> None:
    controller.delta_off = off
    logger.warning("delta pushes off: %s", off.detail)


@contextlib.asynccontextmanager
async def _engine_session(
    controller: InferenceController,
    update: WeightUpdate,
    trainer: TrainerClient,
    config: PushConfig,
    clock: StepClock,
) -> AsyncIterator[_Session]:
    """Engines quiesced and in one group with the trainer: yields the session (group, buckets, whether the
    group was kept, how this push sends: docs/weights.md "Delta push").

    The group is the one the last push kept when it joins the same processes, else a fresh one (the old
    one is torn down). The trainer's Describe runs while the engines quiesce, and each engine runs its own
    chain of calls (pause -> flush -> begin; at the end version -> end -> continue): no engine waits for
    the others between two of its own steps."""
    clients = update.clients
    members = member_ids(update.engines)
    # Until this push succeeds no group is known to join every member; a failure tears it down.
    old, controller.kept_push_group = controller.kept_push_group, None
    group: GroupSpec | None = None
    try:
        with clock("prepare"):
            quiesce = clock.timed("quiesce", all_or_none(_quiesce(c, config) for c in clients))
            joined = None
            if config.keep_group and layout_known(old, members, config.backend) and old is not None:
                # the image is of the last push's buckets: another plan is recorded anew
                same_plan = old.planned_with == (config.bucket_bytes, config.flattened)
                mode = delta_mode(config.delta, same_plan, old, controller.delta_off)
                joined = await _join_kept(trainer, old, quiesce, config, clock, mode)
                quiesce = None
            if joined is None:
                # the group is chosen before it is joined, so a failed join tears it down too
                chosen = await _describe_and_choose(update, trainer, old, members, quiesce, config, clock)
                group, buckets, reuse, _ = chosen
                same_plan = old is not None and tuple(tuple(b) for b in buckets) == old.buckets
                mode = delta_mode(config.delta, reuse and same_plan, old, controller.delta_off)
                await _join_chosen(clients, update, trainer, chosen, config, clock, mode)
            else:
                group, buckets, reuse = joined
        fallback = fallback_reason(mode, config.delta, controller.delta_off)
        session = _Session(group, buckets, reuse, mode, fallback)
        yield session
        await _end_session(controller, update, trainer, session, members, config, clock)
    except BaseException:
        doomed = {g.group_name for g in (group, old.spec if old else None) if g is not None}
        await _cleanup_after_failure(clients, trainer, sorted(doomed), config.cleanup_timeout_s)
        raise


Joined = tuple[GroupSpec, list[list[TensorMeta]], bool]  # the group, the buckets, the group was kept


def _bucket_names(buckets: list[list[TensorMeta]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(meta.name for meta in bucket) for bucket in buckets)


async def _join_kept(
    trainer: TrainerClient,
    old: KeptGroup,
    quiesce: Awaitable[Any],
    config: PushConfig,
    clock: StepClock,
    mode: DeltaMode,
) -> Joined | None:
    """The kept group's steady state: plan from the tensors its last push sent and send the trainer's Join
    while the engines quiesce, with no Describe first. None when the trainer answers StaleLayout (it kept
    no such group, or its tensors changed): then Describe decides, as for any other push."""
    planned_with = (config.bucket_bytes, config.flattened)
    if old.planned_with == planned_with:  # planning walks every tensor: the last push's plan holds
        buckets = [list(bucket) for bucket in old.buckets]
    else:
        buckets = plan_buckets(old.tensors, config.bucket_bytes, flattened=config.flattened)
    names = _bucket_names(buckets)
    join = Join(old.spec, names, config.flattened, reuse=True, layout_known=True, delta=mode)
    answer, _ = await all_or_none([clock.timed("join", _send(trainer, join)), quiesce])
    if isinstance(answer, StaleLayout):
        logger.info("the kept group's layout no longer holds (%s); describing the trainer", answer.reason)
        return None
    return old.spec, buckets, True


# Joined, and the group a fresh join makes the engines leave first (None: nothing to leave, or reused).
Chosen = tuple[GroupSpec, list[list[TensorMeta]], bool, str | None]


async def _describe_and_choose(
    update: WeightUpdate,
    trainer: TrainerClient,
    old: KeptGroup | None,
    members: tuple[MemberId, ...],
    quiesce: Awaitable[Any] | None,
    config: PushConfig,
    clock: StepClock,
) -> Chosen:
    """Describe (beside the engines' quiesce, unless done), plan, and choose the group: the kept one when
    it joins these processes, else a fresh one."""
    describe = Describe(listen=old is None or not config.keep_group)  # reusing needs no new store
    steps = [clock.timed("describe", trainer.run(describe)), *([quiesce] if quiesce is not None else [])]
    info: SenderInfo = (await all_or_none(steps))[0]
    buckets = plan_buckets(info.tensors, config.bucket_bytes, flattened=config.flattened)
    reuse = config.keep_group and reusable(old, members, config.backend, info.kept_group)
    if reuse and old is not None:
        return old.spec, buckets, True, None
    # the trainer names its kept group too: a driver that restarted (no record) still has the engines
    # leave it
    stale = old.spec.group_name if old is not None else info.kept_group
    return _fresh_group(info, update, config), buckets, False, stale


async def _join_chosen(
    clients: Sequence[SGLangApiClient],
    update: WeightUpdate,
    trainer: TrainerClient,
    chosen: Chosen,
    config: PushConfig,
    clock: StepClock,
    mode: DeltaMode,
) -> None:
    """The trainer takes the kept group, or every member joins the fresh one (leaving the stale one)."""
    group, buckets, reuse, stale = chosen
    with clock("join"):
        join = Join(group, _bucket_names(buckets), config.flattened, reuse=reuse, delta=mode)
        if reuse:
            await _send(trainer, join)
        else:
            await _join_group(clients, update, trainer, join, stale, config.cleanup_timeout_s)


def _fresh_group(info: Any, update: WeightUpdate, config: PushConfig) -> GroupSpec:
    return GroupSpec(
        master_address=info.master_address,
        master_port=info.master_port,
        world_size=1 + sum(cell.gpus for cell in update.engines),
        group_name=f"miles-push-v{update.version}-{uuid.uuid4().hex[:8]}",
        backend=config.backend,
        timeout_s=config.group_timeout_s,
    )


async def _end_session(
    controller: InferenceController,
    update: WeightUpdate,
    trainer: TrainerClient,
    session: _Session,
    members: tuple[MemberId, ...],
    config: PushConfig,
    clock: StepClock,
) -> None:
    """Every member ends the push at once, keeping the group (or, keep_group=False, leaving it: an NCCL
    communicator's shutdown waits for its peers' shutdown, so one side waiting for the other never ends)."""
    keep = config.keep_group
    group = session.group
    leave = None if keep else group.group_name
    version = str(update.version)
    with clock("release"):
        await all_or_none(
            [
                trainer.run(Close(group.group_name, keep=keep)),
                *(_release(c, leave, version, config) for c in update.clients),
            ]
        )
    if keep:
        planned = tuple(tuple(bucket) for bucket in session.buckets)
        planned_with = (config.bucket_bytes, config.flattened)
        controller.kept_push_group = KeptGroup(group, members, planned, planned_with, session.verified)


async def _quiesce(client: SGLangApiClient, config: PushConfig) -> None:
    await client.pause_generation(config.pause_mode)
    if not config.flush_cache:
        await client.begin_weight_update()
        return
    # Both need generation paused and neither needs the other: one round trip instead of two. A failure
    # of either cancels the other; the cleanup ends a session that the begin may have opened.
    await all_or_none([client.flush_cache(), client.begin_weight_update()])


async def _release(client: SGLangApiClient, group_name: str | None, version: str, config: PushConfig) -> None:
    """`group_name`: the group to leave first (None: the group is kept)."""
    if group_name is not None:
        await client.destroy_weights_update_group(group_name)
    await client.update_weight_version(version, config.abort_on_version_update)
    await client.end_weight_update()
    await client.continue_generation()


async def _join_group(
    clients: Sequence[SGLangApiClient],
    update: WeightUpdate,
    trainer: TrainerClient,
    join: Join,
    stale: str | None,
    stale_timeout_s: float,
) -> None:
    """Trainer rank 0 and every engine join at once: each side blocks until all have joined. `stale`: a
    group an earlier push kept, which each engine leaves first (the trainer's Join leaves its own); a
    respawned engine never had it, and its refusal is ignored."""

    async def leave_stale(client: SGLangApiClient) -> None:
        if stale is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.destroy_weights_update_group(stale), stale_timeout_s)

    group = join.group
    offsets, cursor = [], 1
    for cell in update.engines:
        offsets.append(cursor)
        cursor += cell.gpus

    async def engine_joins(client: SGLangApiClient, offset: int) -> None:
        await leave_stale(client)
        await client.init_weights_update_group(
            master_address=group.master_address,
            master_port=group.master_port,
            rank_offset=offset,
            world_size=group.world_size,
            group_name=group.group_name,
            backend=group.backend,
        )

    joins = [engine_joins(client, offset) for client, offset in zip(clients, offsets, strict=True)]
    await all_or_none([_send(trainer, join), *joins])


async def _push_bucket(
    clients: Sequence[SGLangApiClient],
    trainer: TrainerClient,
    session: _Session,
    index: int,
    bucket: list[TensorMeta],
    config: PushConfig,
    clock: StepClock,
    on_bucket_in_flight: BucketHook | None,
) -> BucketTiming:
    group = session.group
    load_format = "flattened_bucket" if config.flattened else None
    receives = [
        client.update_weights_from_distributed(
            names=[m.name for m in bucket],
            dtypes=[m.dtype for m in bucket],
            shapes=[list(m.shape) for m in bucket],
            group_name=group.group_name,
            flush_cache=False,
            load_format=DELTA_LOAD_FORMAT if session.mode == "send" else load_format,
        )
        for client in clients
    ]
    start_s = clock.now()
    trainer_done: list[float] = []

    async def send() -> SentBucket:
        sent = await _send(trainer, Broadcast(group.group_name, index))
        trainer_done.append(clock.now())
        return sent

    during = (lambda: on_bucket_in_flight(index)) if on_bucket_in_flight else None
    sent = (await all_or_none([send(), *receives], during=during))[0]
    return BucketTiming(
        sent.bytes,
        start_s,
        sent.pack_wait_s,
        sent.wire_s,
        trainer_done[0],
        clock.now(),
        sent.dense_bytes,
        sent.form,
        sent.changed,
        sent.encode_s,
    )


async def _cleanup_after_failure(
    clients: Sequence[SGLangApiClient], trainer: TrainerClient, groups: Sequence[str], timeout_s: float
) -> None:
    """Best effort, bounded: the trainer leaves `groups` (this push's, and one an earlier push kept) while
    each engine drops them, closes its update session and resumes generation (whichever side leaves first,
    the other side's pending receive or broadcast fails fast). The trainer aborts (a peer may be dead)."""

    async def trainer_leaves() -> None:
        for name in groups:
            with contextlib.suppress(Exception):
                await trainer.run(Close(name, abort=True))

    async def engine_leaves(client: SGLangApiClient) -> None:
        for name in groups:
            with contextlib.suppress(Exception):
                await client.destroy_weights_update_group(name)
        with contextlib.suppress(Exception):
            await client.end_weight_update()
        with contextlib.suppress(Exception):
            await client.continue_generation()

    async def steps() -> None:
        # Each side leaves on its own: a trainer still inside a broadcast that one engine never joined (its
        # request was cut before it arrived) runs Close only after that broadcast fails, which the engines
        # leaving the group makes happen; waiting for Close first would keep every engine's session open.
        await asyncio.gather(trainer_leaves(), *(engine_leaves(c) for c in clients))

    try:
        await asyncio.wait_for(steps(), timeout_s)
    except Exception as exc:  # never mask the push's own error
        logger.warning("cleanup after a failed push did not finish: %s", exc)


async def all_or_none(awaitables: Any, *, during: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
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


async def drop_kept_group(
    controller: InferenceController, trainer: TrainerClient, timeout_s: float = 30.0
) -> bool:
    """Leave the kept group on every member at once (at shutdown, before the processes exit: an NCCL
    communicator destroyed at exit waits for its peers'). True when there was one."""
    kept, controller.kept_push_group = controller.kept_push_group, None
    if kept is None:
        return False
    name = kept.spec.group_name
    clients = [client for cell in controller.cells if (client := getattr(cell, "client", None)) is not None]
    leaves = [trainer.run(Close(name)), *(c.destroy_weights_update_group(name) for c in clients)]
    await asyncio.wait_for(asyncio.gather(*leaves, return_exceptions=True), timeout_s)
    return True


# ----- adapters ------------------------------------------------------------------------------------------


async def publish_adapter_dir(
    controller: InferenceController, *, lora_name: str, path: str | Path, wait_for_engines_s: float = 600.0
) -> None:
    """(Re)load an already exported PEFT directory on every serving engine as `lora_name`."""
    resolved = str(Path(path).resolve())
    if not Path(resolved).is_dir():
        raise ValueError(f"adapter directory {resolved!r} does not exist; export the adapter first")
    started = time.monotonic()
    with metered_push("adapter"):
        async with controller.weight_update(wait_timeout_s=wait_for_engines_s, base_weights=False) as update:
            await all_or_none(_reload_adapter(client, lora_name, resolved) for client in update.clients)
            controller.published_adapters[lora_name] = resolved
    job_metrics().adapters_loaded.set(len(controller.published_adapters))
    observe_push("adapter", None, time.monotonic() - started)


async def unload_adapter(controller: InferenceController, *, lora_name: str) -> None:
    async with controller.weight_update(base_weights=False) as update:
        await all_or_none(_unload_if_loaded(client, lora_name) for client in update.clients)
        controller.published_adapters.pop(lora_name, None)
    job_metrics().adapters_loaded.set(len(controller.published_adapters))


async def reload_published_adapters(controller: InferenceController) -> None:
    """Refresher for LoRA deployments: a respawned engine gets every published adapter again."""
    async with controller.weight_update(base_weights=False) as update:
        # READY engines hold every published adapter already; reloading one there (unload + load) would
        # fail the samples routed to it in between ("adapter not loaded")
        clients = [cell.client for cell in update.engines if cell.state is not CellState.READY]
        for name, path in sorted(controller.published_adapters.items() if clients else ()):
            if not Path(path).is_dir():  # its checkpoint was deleted: nothing can sample from it any more
                logger.warning("adapter %s: %s is gone; not reloading it", name, path)
                controller.published_adapters.pop(name, None)
                continue
            await all_or_none(_reload_adapter(client, name, path) for client in clients)


async def _reload_adapter(client: SGLangApiClient, name: str, path: str) -> None:
    await _unload_if_loaded(client, name)
    await client.load_lora_adapter(name, path)


async def _unload_if_loaded(client: SGLangApiClient, name: str) -> None:
    from miles.engines.errors import EngineRefused

    with contextlib.suppress(EngineRefused):  # "not loaded": nothing to unload
        await client.unload_lora_adapter(name)
