"""Submitting operations: dedup claims, futures, the per-model seq queues, bounded execution.

A retried submit (same (model_id, seq_id), same (sampling_session_id, seq_id), or the same
X-Idempotency-Key for a tenant) gets the original request_id: `DedupClaims`, each claim living
queue_timeout + execution_timeout + 60 s (`claim_ttl_s`), as long as the work it guards. Every operation's
outcome lands in its future (`FutureRepository`): a result, or `{error, category}` with the cause's type
and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from miles.errors import Category
from miles.gateway.errors import describe_failure
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.ordering import SeqQueue
from miles.gateway.sessions import session_of
from miles.gateway.settings import GatewaySettings
from miles.gateway.stages import StageClock, StageClocks
from miles.gateway.traces import SessionTraces, Traced, operation_spans
from miles.state import StateStoreError, StateStoreUnavailable
from miles.state.claims import DedupClaims
from miles.state.futures import FutureRepository

log = logging.getLogger(__name__)

# An operation returns a JSON-able dict (JSON future) or bytes (protobuf future).
OpResult = dict[str, Any] | bytes
Operation = Callable[[], Awaitable[OpResult]]
Release = Callable[[str], Awaitable[None]]
# (model_id, kind, cause): told when the execution timeout cut a model's operation (the runtime's
# miles.seam.runtime.report_operation_timeout); must not block
TimeoutHook = Callable[[str, str, str], None]
# (cause): told when the execution timeout cut one concurrent operation (a sample: its sampling lane's
# report, miles.seam.runtime.report_sampling_timeout); must not block
CutHook = Callable[[str], None]


class Operations:
    def __init__(
        self,
        futures: FutureRepository,
        claims: DedupClaims,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        on_timeout: TimeoutHook | None = None,
    ) -> None:
        self._futures = futures
        self._claims = claims
        self._settings = settings
        self._metrics = metrics
        self._on_timeout = on_timeout
        self._queues: dict[str, SeqQueue] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.stages = StageClocks()
        self.traces = SessionTraces()

    @property
    def futures(self) -> FutureRepository:
        return self._futures

    def queue_for(self, model_id: str, *, first_seq: int = 0) -> SeqQueue:
        queue = self._queues.get(model_id)
        if queue is None:
            queue = SeqQueue(model_id, first_seq=first_seq, gap_timeout_s=self._settings.seq_gap_timeout_s)
            self._queues[model_id] = queue
        return queue

    def training_waiting(self) -> int:
        """Training operations queued behind the running ones, over every model (elastic training)."""
        return sum(queue.waiting for queue in self._queues.values())

    def has_queue(self, model_id: str) -> bool:
        return model_id in self._queues

    def skip_refused(self, model_id: str, seq_id: int) -> bool:
        """The gateway refused the request at (model_id, seq_id) before queueing it: let later ones run.
        A model without a queue needs nothing: its first queued request sets where the queue starts."""
        queue = self._queues.get(model_id)
        return queue is not None and queue.skip(seq_id)

    async def close_queue(self, model_id: str, reason: str, *, cancel_running: bool = True) -> None:
        queue = self._queues.pop(model_id, None)
        if queue is not None:
            await queue.close(reason, cancel_running=cancel_running)

    def release_model(self, model_id: str, reason: str, release: Release) -> asyncio.Task[None]:
        """In the background: refuse the model's queued operations with `reason`, let the running one
        finish, then `release(model_id)` so the runtime frees what the model holds."""

        async def run() -> None:
            try:
                await self.close_queue(model_id, reason, cancel_running=False)
                await release(model_id)
            except Exception:
                log.exception("releasing model %s failed", model_id)

        return self._spawn(run(), f"release-{model_id}")

    def _spawn(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _claim(
        self, tenant: str, kind: str, model_id: str | None, claim_keys: list[str]
    ) -> tuple[str, bool]:
        """(request_id, is_new): an existing request_id when any claim key was seen before."""
        for key in claim_keys:
            holder = await self._claims.holder(key)
            if holder is not None:
                return holder, False
        request_id = self._futures.new_request_id()
        await self._futures.open(request_id, tenant, kind, model_id=model_id)
        won: list[str] = []
        try:
            for key in claim_keys:
                holder = await self._claims.claim(key, request_id, self._settings.dedup_claim_ttl_s)
                if holder is not None:
                    # A concurrent duplicate won the race: answer with its request_id.
                    await self._unclaim(request_id, won)
                    return holder, False
                won.append(key)
        except StateStoreUnavailable:
            # The caller is told 503 and will resend: try to leave no claim naming a future nobody polls.
            for key in won:
                with contextlib.suppress(StateStoreError):
                    await self._claims.release(key, request_id)
            with contextlib.suppress(StateStoreError):
                await self._futures.discard(request_id)
            raise
        return request_id, True

    async def _unclaim(self, request_id: str, claimed: list[str]) -> None:
        for key in claimed:
            await self._claims.release(key, request_id)
        await self._futures.discard(request_id)

    @staticmethod
    def claim_keys(dedup: str | None, tenant: str, idempotency_key: str | None) -> list[str]:
        """`dedup`: a `DedupClaims.seq_key`/`sample_key` (its id is already owned by one tenant)."""
        keys = [] if dedup is None else [dedup]
        if idempotency_key:
            keys.append(DedupClaims.idempotency_key(tenant, idempotency_key))
        return keys

    async def submit_ordered(
        self,
        *,
        tenant: str,
        kind: str,
        model_id: str,
        seq_id: int | None,
        idempotency_key: str | None,
        operation: Operation,
        first_seq: int = 0,
        clock: StageClock | None = None,
    ) -> str:
        """`clock`: the operation's stage timings, kept for `retrieve_future` (see miles.gateway.stages)."""
        dedup = None if seq_id is None else DedupClaims.seq_key(model_id, seq_id)
        keys = self.claim_keys(dedup, tenant, idempotency_key)
        request_id, is_new = await self._claim(tenant, kind, model_id, keys)
        if not is_new:
            self._metrics.deduplicated.labels(kind).inc()
            return request_id
        queued_at = time.monotonic()
        traced = Traced(session_of(model_id), model_id)
        self._metrics.model_tenant.labels(model_id, tenant).set(1)
        depth = self._metrics.queue_depth.labels(model_id)
        depth.inc()

        async def job() -> None:
            if clock is not None:
                clock.mark("queue_wait")
            waited = time.monotonic() - queued_at
            depth.dec()
            self._metrics.queue_wait.labels(model_id).observe(waited)
            if waited > self._settings.queue_timeout_s:
                await self._futures.fail(
                    request_id,
                    f"{kind} waited {waited:.0f} s in the queue (queue_timeout_s)",
                    Category.TIMEOUT,
                )
                return
            await self._execute(request_id, kind, operation, clock, model_id=model_id, traced=traced)

        async def reject(message: str) -> None:
            depth.dec()
            await self._futures.fail(request_id, message, Category.USER)

        if clock is not None:
            self.stages.keep(request_id, clock)
            clock.mark("admit")
        await self.queue_for(model_id, first_seq=first_seq).submit(seq_id, job, reject)
        # One turn of the loop: a queue that can run the job starts it (up to its first real wait, e.g. the
        # trainer call) before the submit is answered, so answering overlaps the work instead of delaying it.
        await asyncio.sleep(0)
        return request_id

    async def submit_concurrent(
        self,
        *,
        tenant: str,
        kind: str,
        model_id: str | None,
        dedup: str | None,
        idempotency_key: str | None,
        operation: Operation,
        slots: contextlib.AbstractAsyncContextManager[Any],
        on_timeout: CutHook | None = None,
        traced: Traced | None = None,
        clock: StageClock | None = None,
    ) -> tuple[str, bool]:
        """Run without ordering (sampling) once `slots` lets it in (the future stays pending until then).
        `on_timeout` hears the cause if the execution timeout cuts it; `traced`: the session trace it goes
        to, if any. (request_id, is_new)."""
        keys = self.claim_keys(dedup, tenant, idempotency_key)
        request_id, is_new = await self._claim(tenant, kind, model_id, keys)
        if not is_new:
            self._metrics.deduplicated.labels(kind).inc()
            return request_id, False

        async def run() -> None:
            async with slots:
                if clock is not None:  # the wait for a slot, as an ordered operation's for its turn
                    clock.mark("queue_wait")
                await self._execute(
                    request_id,
                    kind,
                    operation,
                    clock,
                    model_id=model_id,
                    on_timeout=on_timeout,
                    traced=traced,
                )

        self._spawn(run(), f"{kind}-{request_id}")
        return request_id, True

    async def _execute(
        self,
        request_id: str,
        kind: str,
        operation: Operation,
        clock: StageClock | None = None,
        *,
        model_id: str | None = None,
        on_timeout: CutHook | None = None,
        traced: Traced | None = None,
    ) -> None:
        """`on_timeout`: who hears a cut besides the runtime's model hook (which needs `model_id`)."""
        started_s = time.time()
        outcome = "cancelled"
        try:
            outcome = await self._run(
                request_id, kind, operation, clock, model_id=model_id, on_timeout=on_timeout
            )
        finally:
            if traced is not None:
                spans = operation_spans(
                    kind=kind,
                    track=traced.track,
                    request_id=request_id,
                    submitted_s=traced.submitted_s,
                    started_s=started_s,
                    ended_s=time.time(),
                    outcome=outcome,
                    stages_ns=None if clock is None else clock.stages,
                    ranks_ns=() if clock is None else clock.ranks_ns,
                    parts=() if clock is None else clock.parts,
                )
                self.traces.record(traced.session_id, spans)

    async def _run(
        self,
        request_id: str,
        kind: str,
        operation: Operation,
        clock: StageClock | None,
        *,
        model_id: str | None,
        on_timeout: CutHook | None,
    ) -> str:
        """Run the operation and resolve its future; its outcome ("complete" or "failed")."""
        started = time.monotonic()
        # in this task, not a new one (wait_for's): the operation reaches its first real wait (the
        # trainer call) within the loop turn submit_ordered gives it
        deadline = asyncio.timeout(self._settings.execution_timeout_s)
        try:
            await self._futures.mark_running(request_id)
            if clock is not None:
                clock.mark("mark_running")
            async with deadline:
                result = await operation()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._futures.fail(request_id, f"{kind} was cancelled (shutdown)", Category.SERVER)
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():  # ours, not the operation's own
                message, category = self._timed_out(kind, model_id, on_timeout), Category.TIMEOUT
            else:
                message, category = describe_failure(exc)
            await self._futures.fail(request_id, message, category)
            self._metrics.operations.labels(kind, "failed").inc()
            return "failed"
        finally:
            self._metrics.op_seconds.labels(kind).observe(time.monotonic() - started)
        try:
            await self._futures.complete(request_id, result)
        except Exception as exc:  # an encoding bug must still resolve the future
            message, _ = describe_failure(exc)
            await self._futures.fail(request_id, f"could not store the result: {message}", Category.SERVER)
            self._metrics.operations.labels(kind, "failed").inc()
            return "failed"
        if clock is not None:
            clock.mark("publish")
        self._metrics.operations.labels(kind, "complete").inc()
        return "complete"

    def _timed_out(self, kind: str, model_id: str | None, on_timeout: CutHook | None) -> str:
        """The failure text; the runtime hears of the cut first (a catalog job quarantines the instance
        before the caller can see the failure and send its next operation)."""
        limit = self._settings.execution_timeout_s
        subject = kind if model_id is None else f"{kind} on {model_id}"
        cause = f"{subject} ran past the execution timeout ({limit:g} s)"
        hooks: list[CutHook] = [] if on_timeout is None else [on_timeout]
        if model_id is not None and self._on_timeout is not None:
            hooks.append(functools.partial(self._on_timeout, model_id, kind))
        for hook in hooks:
            try:
                hook(cause)
            except Exception:
                log.exception("telling the runtime that %s timed out failed", subject)
        return f"{kind} ran longer than {limit:.0f} s"

    async def close(self) -> None:
        for model_id in list(self._queues):
            await self.close_queue(model_id, "the gateway is shutting down")
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
