"""Futures: an operation's outcome, persisted through the StateStore and resolved by event in-process."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field

from miles.errors import Category, IllegalTransition
from miles.state.records import Clock, Record, Repository, check_transition
from miles.state.store import StateStore, StateStoreError, StateStoreUnavailable

log = logging.getLogger(__name__)

# Futures and their results are kept this long after their last change (the SDK polls long before that).
DEFAULT_FUTURE_TTL_S = 24 * 3600.0
# Outcomes this process wrote and nobody has retrieved yet, answered without a store read (newest kept).
MAX_FINISHED_IN_MEMORY = 256


class FutureState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"


# The one place that says how a future may move. Terminal states have no way out.
FUTURE_TRANSITIONS: dict[FutureState, frozenset[FutureState]] = {
    FutureState.PENDING: frozenset({FutureState.RUNNING, FutureState.COMPLETE, FutureState.FAILED}),
    FutureState.RUNNING: frozenset({FutureState.COMPLETE, FutureState.FAILED}),
    FutureState.COMPLETE: frozenset(),
    FutureState.FAILED: frozenset(),
}


class FutureError(Record):
    message: str
    category: Category = Category.SERVER  # miles.errors: reported to Tinker as .reported


class FutureRecord(Record):
    request_id: str
    tenant: str
    kind: str  # the operation, e.g. "ForwardBackward", "Sample", "SaveWeights"
    model_id: str | None = None
    owner: str = ""  # the process running the work (FutureRepository.owner)
    state: FutureState = FutureState.PENDING
    created_at: float
    updated_at: float
    # JSON text, exactly as answered to clients: it may hold NaN (a loss metric), which store values refuse.
    result_json: str | None = None
    result_b64: str | None = None  # protobuf results (ForwardBackwardOutput, SampleResponse)
    error: FutureError | None = None
    sample_sequence_ids: list[str] = Field(default_factory=list)

    @property
    def done(self) -> bool:
        return not FUTURE_TRANSITIONS[self.state]

    def result_bytes(self) -> bytes | None:
        return None if self.result_b64 is None else base64.b64decode(self.result_b64)

    def result_value(self) -> Any:
        """The JSON result decoded (None for protobuf results and unfinished futures)."""
        return None if self.result_json is None else json.loads(self.result_json)


class FutureRepository(Repository[FutureRecord]):
    """Futures with a transition table, persisted through the store and resolved by event in-process.

    Every stored change refreshes the record's TTL. Each future remembers its `owner` (the repository that
    opened it, i.e. the process that runs the work). A waiter in the owner's process is woken by an
    asyncio.Event the moment the terminal state is written. A non-terminal future of another owner can
    never finish (its work died with that process), so `wait` fails it with a "submit it again" error.

    An outcome reached while the store is unavailable is kept in memory (the work is done: answering
    "submit it again" would run a forward_backward twice) and written by the next `wait` on that future
    once the store answers again.

    The hot path reads the store once per future at most: a waiter on a future this process runs checks
    the tenant against what `open` recorded and waits for the event, and the first `wait` after the outcome
    answers the record exactly as `_move` wrote it to the store (kept in memory until then, the newest
    MAX_FINISHED_IN_MEMORY). Any later `wait`, or one in another process, reads the store.
    """

    namespace = "futures"
    record_type = FutureRecord
    id_field = "request_id"
    RESTARTED = "the gateway restarted before this operation finished; submit it again"

    def __init__(
        self,
        store: StateStore,
        *,
        clock: Clock = time.time,
        ttl_s: float = DEFAULT_FUTURE_TTL_S,
        owner: str | None = None,
        outage_poll_pace_s: float = 1.0,
    ) -> None:
        super().__init__(store, clock=clock)
        self.ttl_s = ttl_s
        self.outage_poll_pace_s = outage_poll_pace_s
        self.owner = owner or uuid.uuid4().hex
        self._resolved: dict[str, asyncio.Event] = {}
        self._unrecorded: dict[str, _Outcome] = {}
        self._running_tenant: dict[str, str] = {}  # futures this process opened and has not ended
        self._finished: dict[str, FutureRecord] = {}  # ended here, not retrieved yet (insertion order)

    @staticmethod
    def new_request_id() -> str:
        return f"req-{uuid.uuid4().hex}"

    async def open(
        self,
        request_id: str,
        tenant: str,
        kind: str,
        *,
        model_id: str | None = None,
        sample_sequence_ids: list[str] | None = None,
    ) -> FutureRecord:
        now = self.clock()
        record = FutureRecord(
            request_id=request_id,
            tenant=tenant,
            kind=kind,
            model_id=model_id,
            owner=self.owner,
            created_at=now,
            updated_at=now,
            sample_sequence_ids=sample_sequence_ids or [],
        )
        if not await self.create(record, ttl_s=self.ttl_s):
            raise StateStoreError(f"future {request_id} already exists")
        self._resolved[request_id] = asyncio.Event()
        self._running_tenant[request_id] = tenant
        return record

    async def discard(self, request_id: str) -> None:
        """Forget a future nobody was told about (it lost a dedup race)."""
        self._resolved.pop(request_id, None)
        self._running_tenant.pop(request_id, None)
        await self.delete(request_id)

    async def _move(self, request_id: str, target: FutureState, **changes: Any) -> FutureRecord | None:
        """The record after the move; None when a final outcome is kept in memory for want of a store."""
        outcome = _Outcome(target, self.clock(), changes)
        final = not FUTURE_TRANSITIONS[target]
        try:
            record = await self.modify(request_id, outcome.apply, ttl_s=self.ttl_s)
        except StateStoreUnavailable:
            if not final:
                raise
            self._keep_unrecorded(request_id, outcome)
            return None
        else:
            if final and record is not None:
                self._keep_finished(record)
        finally:
            if final:  # wake waiters even if the write failed: they re-read
                self._running_tenant.pop(request_id, None)
                event = self._resolved.pop(request_id, None)
                if event is not None:
                    event.set()
        if record is None:
            raise KeyError(f"no future {request_id}")
        return record

    def _keep_finished(self, record: FutureRecord) -> None:
        self._finished[record.request_id] = record
        while len(self._finished) > MAX_FINISHED_IN_MEMORY:
            del self._finished[next(iter(self._finished))]

    def _take_finished(self, tenant: str, request_id: str) -> FutureRecord | None:
        """The outcome as written, once, to its own tenant (anyone else reads the store: None there)."""
        record = self._finished.get(request_id)
        if record is None or record.tenant != tenant:
            return None
        del self._finished[request_id]
        return record

    def _keep_unrecorded(self, request_id: str, outcome: _Outcome) -> None:
        # An outcome nobody asked for within the TTL goes: its record has expired in the store by then.
        for stale in [rid for rid, kept in self._unrecorded.items() if outcome.at - kept.at > self.ttl_s]:
            del self._unrecorded[stale]
        self._unrecorded[request_id] = outcome
        log.warning(
            "future %s ended %s while the state store was unavailable; kept in memory until it answers",
            request_id,
            outcome.target.value,
        )

    async def _record_unrecorded(self, request_id: str) -> None:
        """Write an outcome kept in memory; StateStoreUnavailable again while the store does not answer."""
        outcome = self._unrecorded.get(request_id)
        if outcome is None:
            return
        with contextlib.suppress(IllegalTransition):  # the lost write had landed after all
            await self.modify(request_id, outcome.apply, ttl_s=self.ttl_s)
        del self._unrecorded[request_id]

    async def mark_running(self, request_id: str) -> FutureRecord | None:
        return await self._move(request_id, FutureState.RUNNING)

    async def complete(self, request_id: str, result: Any = None) -> FutureRecord | None:
        """Finish with a JSON-able result (kept as JSON text) or bytes (a serialised protobuf, base64)."""
        if isinstance(result, bytes | bytearray | memoryview):
            encoded = base64.b64encode(bytes(result)).decode("ascii")
            return await self._move(request_id, FutureState.COMPLETE, result_b64=encoded, result_json=None)
        text = json.dumps(result)  # before the move: an unencodable result must not complete the future
        return await self._move(request_id, FutureState.COMPLETE, result_json=text, result_b64=None)

    async def fail(
        self, request_id: str, message: str, category: Category = Category.SERVER
    ) -> FutureRecord | None:
        error = FutureError(message=message, category=category)
        return await self._move(request_id, FutureState.FAILED, error=error)

    async def wait(self, tenant: str, request_id: str, timeout_s: float) -> FutureRecord | None:
        """The tenant's future once done, or as it is after `timeout_s`; None if not there or not theirs.

        While the store is unavailable, one more try after `outage_poll_pace_s` (at most `timeout_s`)
        before StateStoreUnavailable: the SDK polls again at once after a 5xx, and a refused connection
        fails in milliseconds, so without it every pending future would be polled in a tight loop."""
        try:
            return await self._wait_once(tenant, request_id, timeout_s)
        except StateStoreUnavailable:
            await asyncio.sleep(min(timeout_s, self.outage_poll_pace_s))
            return await self._wait_once(tenant, request_id, 0)

    async def _wait_once(self, tenant: str, request_id: str, timeout_s: float) -> FutureRecord | None:
        await self._record_unrecorded(request_id)
        finished = self._take_finished(tenant, request_id)
        if finished is not None:
            return finished
        event = self._resolved.get(request_id)
        if event is not None and self._running_tenant.get(request_id) == tenant:
            # running here: its record can only change through _move, which sets the event
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout_s)
            return self._take_finished(tenant, request_id) or await self.get_owned(tenant, request_id)
        record = await self.get_owned(tenant, request_id)
        if record is None or record.done:
            return record
        if event is None:
            if record.owner != self.owner:
                with contextlib.suppress(IllegalTransition, KeyError):
                    await self.fail(request_id, self.RESTARTED, Category.SERVER)
            return await self.get_owned(tenant, request_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return await self.get_owned(tenant, request_id)

    def pending_count(self) -> int:
        """Futures opened by this process and not yet resolved."""
        return len(self._resolved)


@dataclass(frozen=True)
class _Outcome:
    """A future's move to `target` at `at` (clock time), with the fields it sets."""

    target: FutureState
    at: float
    changes: dict[str, Any]

    def apply(self, record: FutureRecord) -> FutureRecord:
        check_transition(FUTURE_TRANSITIONS, record.state, self.target)
        return record.model_copy(update={"state": self.target, "updated_at": self.at, **self.changes})
