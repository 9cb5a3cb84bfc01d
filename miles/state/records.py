"""Typed records over a StateStore, so callers never spell dict keys by hand.

Each repository owns one namespace. Reads for a tenant (`get_owned`) answer None for another tenant's
record, so "not yours" and "not there" look the same to callers (both become 404).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from miles.errors import Category, IllegalTransition
from miles.state.store import JsonDict, StateStore, StateStoreError, StateStoreUnavailable

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# Futures and their results are kept this long after their last change (the SDK polls long before that).
DEFAULT_FUTURE_TTL_S = 24 * 3600.0
# A dedup claim must outlive the work it guards: queued, executed, then answered.
CLAIM_TTL_MARGIN_S = 60.0
# Outcomes this process wrote and nobody has retrieved yet, answered without a store read (newest kept).
MAX_FINISHED_IN_MEMORY = 256


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat()


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


R = TypeVar("R", bound=Record)


# The SDK's checkpoint_type of each kind (the middle segment of a tinker:// path).
_CHECKPOINT_TYPES: dict[str, Literal["training", "sampler", "external"]] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


class CheckpointRecord(Record):
    """One committed checkpoint, as indexed in the store and written to its metadata.json."""

    tinker_path: str
    tenant: str
    model_id: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    name: str
    created_at: float
    has_optimizer: bool = False
    public: bool = False  # published: every tenant of this job may read (load, sample) it
    base_model: str | None = None
    is_lora: bool | None = None
    lora_rank: int | None = None
    size_bytes: int | None = None
    ttl_seconds: float | None = None
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None

    @property
    def checkpoint_id(self) -> str:
        """`<kind>/<name>` (e.g. `weights/step-3`), as the REST API names it."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> Literal["training", "sampler", "external"]:
        return _CHECKPOINT_TYPES[self.kind]

    def to_tinker(self) -> JsonDict:
        """The SDK's `Checkpoint` shape (REST listings, training runs)."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.checkpoint_type,
            "time": _iso(self.created_at),
            "tinker_path": self.tinker_path,
            "size_bytes": self.size_bytes,
            "public": self.public,
            "user_metadata": self.user_metadata,
            "expires_at": None if self.expires_at is None else _iso(self.expires_at),
        }


class SessionState(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    EXPIRED = "expired"


# A finished or expired session never comes back.
SESSION_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.ACTIVE: frozenset({SessionState.FINISHED, SessionState.EXPIRED}),
    SessionState.FINISHED: frozenset(),
    SessionState.EXPIRED: frozenset(),
}


class SessionRecord(Record):
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    state: SessionState = SessionState.ACTIVE
    ended_at: float | None = None  # when it was finished or expired
    finish_reason: str | None = None
    finish_detail: str | None = None
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state is SessionState.ACTIVE

    def stale(self, now: float, timeout_s: float) -> bool:
        """Active, but silent for longer than `timeout_s`: it should be expired."""
        return self.active and now - self.last_heartbeat > timeout_s


class ModelRecord(Record):
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_mode: Literal["lora", "full"] = "lora"
    created_at: float
    last_request_time: float
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    last_checkpoint: CheckpointRecord | None = None
    last_sampler_checkpoint: CheckpointRecord | None = None


class SamplerRecord(Record):
    sampling_session_id: str
    tenant: str
    base_model: str
    created_at: float
    session_id: str | None = None
    model_id: str | None = None
    model_path: str | None = None  # tinker://... sampler path, None for a base-model sampler
    # kind="inflight": samples from its model's latest inflight save (the record at inflight_target_id)
    inflight: bool = False


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


_TRANSITION_TABLES: dict[type[StrEnum], dict[Any, frozenset[Any]]] = {
    FutureState: FUTURE_TRANSITIONS,
    SessionState: SESSION_TRANSITIONS,
}


def check_transition(current: FutureState | SessionState, target: FutureState | SessionState) -> None:
    """Refuse a move its lifecycle's table does not allow (terminal states have no way out)."""
    table = _TRANSITION_TABLES[type(current)]
    if target not in table[current]:
        what = "future" if isinstance(current, FutureState) else "session"
        raise IllegalTransition(f"{what} cannot go from {current.value} to {target.value}")


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


class Repository(Generic[R]):
    """Typed CRUD for one record kind in one namespace."""

    namespace: ClassVar[str]
    record_type: ClassVar[type[Record]]
    id_field: ClassVar[str]

    def __init__(self, store: StateStore, *, clock: Clock = time.time) -> None:
        self.store = store
        self.clock = clock

    def _load(self, raw: JsonDict | None) -> R | None:
        return None if raw is None else self.record_type.model_validate(raw)  # type: ignore[return-value]

    async def create(self, record: R, *, ttl_s: float | None = None) -> bool:
        """Store a new record; False (and nothing written) if one with that id already exists."""
        key = getattr(record, self.id_field)
        return await self.store.put_if_absent(
            self.namespace, key, record.model_dump(mode="json"), ttl_s=ttl_s
        )

    async def save(self, record: R, *, ttl_s: float | None = None) -> None:
        await self.store.put(
            self.namespace, getattr(record, self.id_field), record.model_dump(mode="json"), ttl_s=ttl_s
        )

    async def get(self, record_id: str) -> R | None:
        return self._load(await self.store.get(self.namespace, record_id))

    async def get_owned(self, tenant: str, record_id: str) -> R | None:
        record = await self.get(record_id)
        return record if record is not None and record.tenant == tenant else None  # type: ignore[attr-defined]

    async def modify(
        self, record_id: str, fn: Callable[[R], R | None], *, ttl_s: float | None = None
    ) -> R | None:
        """Atomically apply `fn` to an existing record (None if there is none; fn returning None deletes)."""

        def apply(raw: JsonDict | None) -> JsonDict | None:
            current = self._load(raw)
            if current is None:
                return None
            new = fn(current)
            return None if new is None else new.model_dump(mode="json")

        return self._load(await self.store.update(self.namespace, record_id, apply, ttl_s=ttl_s))

    async def list(self, *, tenant: str | None = None, prefix: str = "") -> list[R]:
        records = [self._load(raw) for _, raw in await self.store.list(self.namespace, prefix)]
        return [r for r in records if r is not None and (tenant is None or r.tenant == tenant)]  # type: ignore[attr-defined]

    async def delete(self, record_id: str) -> bool:
        return await self.store.delete(self.namespace, record_id)


class SessionRepository(Repository[SessionRecord]):
    """Sessions move ACTIVE -> FINISHED | EXPIRED only (SESSION_TRANSITIONS); an ended session stays ended."""

    namespace = "sessions"
    record_type = SessionRecord
    id_field = "session_id"

    async def open(
        self, session_id: str, tenant: str, *, tags: list[str], user_metadata: dict[str, Any]
    ) -> SessionRecord:
        now = self.clock()
        record = SessionRecord(
            session_id=session_id,
            tenant=tenant,
            created_at=now,
            last_heartbeat=now,
            tags=list(tags),
            user_metadata=dict(user_metadata),
        )
        if not await self.create(record):
            raise StateStoreError(f"session {session_id} already exists")
        return record

    async def heartbeat(self, session_id: str) -> SessionRecord | None:
        """Record a heartbeat; an ended session is returned unchanged (the caller answers 410)."""
        now = self.clock()

        def beat(rec: SessionRecord) -> SessionRecord:
            return rec.model_copy(update={"last_heartbeat": now}) if rec.active else rec

        return await self.modify(session_id, beat)

    async def end(
        self, session_id: str, target: SessionState, reason: str | None, detail: str | None = None
    ) -> tuple[SessionRecord | None, bool]:
        """Finish or expire an active session: (the record, whether this call ended it).

        Ending an already-ended session changes nothing (the first end's state, reason and time are kept),
        so exactly one caller learns that it ended the session and releases what it held.
        """
        check_transition(SessionState.ACTIVE, target)
        now = self.clock()
        ended_now = False

        def end(rec: SessionRecord) -> SessionRecord:
            nonlocal ended_now
            ended_now = rec.active  # fn may run more than once (Redis retries): the last run is what sticks
            if not ended_now:
                return rec
            update = {"state": target, "ended_at": now, "finish_reason": reason, "finish_detail": detail}
            return rec.model_copy(update=update)

        record = await self.modify(session_id, end)
        return record, ended_now and record is not None

    async def expire_if_stale(self, session_id: str, timeout_s: float) -> tuple[SessionRecord | None, bool]:
        """Expire the session if it is active and silent for longer than `timeout_s` (atomically)."""
        now = self.clock()
        expired_now = False

        def expire(rec: SessionRecord) -> SessionRecord:
            nonlocal expired_now
            expired_now = rec.stale(now, timeout_s)
            if not expired_now:
                return rec
            update = {"state": SessionState.EXPIRED, "ended_at": now, "finish_reason": "expired"}
            return rec.model_copy(update=update)

        record = await self.modify(session_id, expire)
        return record, expired_now and record is not None

    async def stale_sessions(self, timeout_s: float) -> list[SessionRecord]:
        """Active sessions silent for longer than `timeout_s` (candidates for `expire_if_stale`)."""
        now = self.clock()
        return [rec for rec in await self.list() if rec.stale(now, timeout_s)]


class ModelRepository(Repository[ModelRecord]):
    namespace = "models"
    record_type = ModelRecord
    id_field = "model_id"

    async def touch(self, model_id: str) -> ModelRecord | None:
        now = self.clock()
        return await self.modify(model_id, lambda rec: rec.model_copy(update={"last_request_time": now}))

    async def touch_owned(self, tenant: str, model_id: str) -> ModelRecord | None:
        """`touch` the tenant's model in one store call (the read and the write of a request's hot path);
        None, and nothing changed, for a model that is not there or not theirs."""
        now = self.clock()

        def touched(rec: ModelRecord) -> ModelRecord:
            return rec.model_copy(update={"last_request_time": now}) if rec.tenant == tenant else rec

        record = await self.modify(model_id, touched)
        return record if record is not None and record.tenant == tenant else None


class SamplerRepository(Repository[SamplerRecord]):
    namespace = "samplers"
    record_type = SamplerRecord
    id_field = "sampling_session_id"


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
        check_transition(record.state, self.target)
        return record.model_copy(update={"state": self.target, "updated_at": self.at, **self.changes})


def claim_ttl_s(queue_timeout_s: float, execution_timeout_s: float) -> float:
    """How long a dedup claim must live: the guarded work may queue, then run, then be answered."""
    if queue_timeout_s < 0 or execution_timeout_s < 0:
        raise ValueError("queue_timeout_s and execution_timeout_s must be >= 0")
    return queue_timeout_s + execution_timeout_s + CLAIM_TTL_MARGIN_S


class DedupClaims:
    """First-submit-wins claims: a retried submit learns the original request_id."""

    namespace = "dedup"

    def __init__(self, store: StateStore, *, min_ttl_s: float = CLAIM_TTL_MARGIN_S) -> None:
        self.store = store
        self.min_ttl_s = min_ttl_s

    @staticmethod
    def seq_key(model_id: str, seq_id: int) -> str:
        return f"seq:{model_id}:{seq_id}"

    @staticmethod
    def sample_key(sampling_session_id: str, seq_id: int) -> str:
        return f"sample:{sampling_session_id}:{seq_id}"

    @staticmethod
    def idempotency_key(tenant: str, key: str) -> str:
        return f"idem:{tenant}:{key}"

    async def claim(self, key: str, request_id: str, ttl_s: float) -> str | None:
        """Claim `key` for `request_id`: None if we won, else the request_id that holds it."""
        if ttl_s < self.min_ttl_s:
            raise ValueError(
                f"dedup claim ttl {ttl_s} s is below the minimum {self.min_ttl_s} s (see claim_ttl_s)"
            )
        # The holder may expire between our failed claim and our read; then claim again.
        for _ in range(3):
            if await self.store.put_if_absent(self.namespace, key, {"request_id": request_id}, ttl_s=ttl_s):
                return None
            holder = await self.store.get(self.namespace, key)
            if holder is not None:
                return str(holder["request_id"])
        raise StateStoreError(f"dedup claim {key} kept expiring while being read")

    async def holder(self, key: str) -> str | None:
        held = await self.store.get(self.namespace, key)
        return None if held is None else str(held["request_id"])

    async def release(self, key: str, request_id: str) -> bool:
        """Drop the claim only if `request_id` still holds it (e.g. its submit failed before queueing)."""
        released = False

        def drop_if_mine(held: JsonDict | None) -> JsonDict | None:
            nonlocal released
            released = held is not None and held.get("request_id") == request_id
            return None if released else held

        await self.store.update(self.namespace, key, drop_if_mine)
        return released
