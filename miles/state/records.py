"""Typed records over a StateStore, so callers never spell dict keys by hand.

Each repository owns one namespace. Reads for a tenant (`get_owned`) answer None for another tenant's
record, so "not yours" and "not there" look the same to callers (both become 404).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from miles.state.store import JsonDict, StateStore, StateStoreError

Clock = Callable[[], float]

# Futures and their results are kept this long after their last change (the SDK polls long before that).
DEFAULT_FUTURE_TTL_S = 24 * 3600.0
# A dedup claim must outlive the work it guards: queued, executed, then answered.
CLAIM_TTL_MARGIN_S = 60.0


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat()


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


R = TypeVar("R", bound=Record)


class CheckpointRecord(Record):
    """One committed checkpoint, as indexed in the store and written to its metadata.json."""

    tinker_path: str
    tenant: str
    model_id: str
    kind: Literal["weights", "sampler_weights"]
    name: str
    created_at: float
    has_optimizer: bool = False
    base_model: str | None = None
    is_lora: bool | None = None
    lora_rank: int | None = None
    size_bytes: int | None = None
    ttl_seconds: float | None = None
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None

    @property
    def checkpoint_id(self) -> str:
        """`weights/<name>` or `sampler_weights/<name>`, as the REST API names it."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> Literal["training", "sampler"]:
        return "training" if self.kind == "weights" else "sampler"

    def to_tinker(self) -> JsonDict:
        """The SDK's `Checkpoint` shape (REST listings, training runs)."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.checkpoint_type,
            "time": _iso(self.created_at),
            "tinker_path": self.tinker_path,
            "size_bytes": self.size_bytes,
            "public": False,
            "user_metadata": self.user_metadata,
            "expires_at": None if self.expires_at is None else _iso(self.expires_at),
        }


class SessionRecord(Record):
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    finished_at: float | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


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
    snapshot_dir: str | None = None


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


class InvalidTransition(StateStoreError):
    """A future was asked to move along an edge FUTURE_TRANSITIONS does not have."""


def check_transition(current: FutureState, target: FutureState) -> None:
    if target not in FUTURE_TRANSITIONS[current]:
        raise InvalidTransition(f"future cannot go from {current.value} to {target.value}")


class FutureError(Record):
    message: str
    category: Literal["user", "server", "unknown"] = "server"


class FutureRecord(Record):
    request_id: str
    tenant: str
    kind: str  # the operation, e.g. "ForwardBackward", "Sample", "SaveWeights"
    model_id: str | None = None
    state: FutureState = FutureState.PENDING
    created_at: float
    updated_at: float
    result_json: Any = None
    result_b64: str | None = None  # protobuf results (ForwardBackwardOutput, SampleResponse)
    error: FutureError | None = None
    sample_sequence_ids: list[str] = Field(default_factory=list)

    @property
    def done(self) -> bool:
        return not FUTURE_TRANSITIONS[self.state]

    def result_bytes(self) -> bytes | None:
        return None if self.result_b64 is None else base64.b64decode(self.result_b64)


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
    namespace = "sessions"
    record_type = SessionRecord
    id_field = "session_id"
    counters_namespace = "session-counters"

    async def heartbeat(self, session_id: str) -> SessionRecord | None:
        """Record a heartbeat; a finished session is returned unchanged (the caller answers 410)."""
        now = self.clock()

        def beat(rec: SessionRecord) -> SessionRecord:
            return rec if rec.finished else rec.model_copy(update={"last_heartbeat": now})

        return await self.modify(session_id, beat)

    async def finish(self, session_id: str, reason: str, detail: str | None = None) -> SessionRecord | None:
        """Mark finished (idempotent: the first finish's reason and time are kept)."""
        now = self.clock()

        def finish(rec: SessionRecord) -> SessionRecord:
            if rec.finished:
                return rec
            return rec.model_copy(
                update={"finished_at": now, "finish_reason": reason, "finish_detail": detail}
            )

        return await self.modify(session_id, finish)

    async def next_model_seq(self, session_id: str) -> int:
        """The session's next model_seq_id, counting from 0."""
        return await self.store.incr(self.counters_namespace, f"{session_id}:model_seq") - 1

    async def next_sampling_seq(self, session_id: str) -> int:
        """The session's next sampling_session_seq_id, counting from 0."""
        return await self.store.incr(self.counters_namespace, f"{session_id}:sampling_seq") - 1


class ModelRepository(Repository[ModelRecord]):
    namespace = "models"
    record_type = ModelRecord
    id_field = "model_id"

    async def touch(self, model_id: str) -> ModelRecord | None:
        now = self.clock()
        return await self.modify(model_id, lambda rec: rec.model_copy(update={"last_request_time": now}))


class SamplerRepository(Repository[SamplerRecord]):
    namespace = "samplers"
    record_type = SamplerRecord
    id_field = "sampling_session_id"


class FutureRepository(Repository[FutureRecord]):
    """Futures with a transition table; every stored change refreshes the record's TTL."""

    namespace = "futures"
    record_type = FutureRecord
    id_field = "request_id"

    def __init__(
        self, store: StateStore, *, clock: Clock = time.time, ttl_s: float = DEFAULT_FUTURE_TTL_S
    ) -> None:
        super().__init__(store, clock=clock)
        self.ttl_s = ttl_s

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
            created_at=now,
            updated_at=now,
            sample_sequence_ids=sample_sequence_ids or [],
        )
        if not await self.create(record, ttl_s=self.ttl_s):
            raise StateStoreError(f"future {request_id} already exists")
        return record

    async def _move(self, request_id: str, target: FutureState, **changes: Any) -> FutureRecord:
        now = self.clock()

        def move(rec: FutureRecord) -> FutureRecord:
            check_transition(rec.state, target)
            return rec.model_copy(update={"state": target, "updated_at": now, **changes})

        record = await self.modify(request_id, move, ttl_s=self.ttl_s)
        if record is None:
            raise KeyError(f"no future {request_id}")
        return record

    async def mark_running(self, request_id: str) -> FutureRecord:
        return await self._move(request_id, FutureState.RUNNING)

    async def complete(self, request_id: str, result: Any = None) -> FutureRecord:
        """Finish with a JSON-able result, or bytes (a serialised protobuf) kept as base64."""
        if isinstance(result, bytes | bytearray | memoryview):
            encoded = base64.b64encode(bytes(result)).decode("ascii")
            return await self._move(request_id, FutureState.COMPLETE, result_b64=encoded, result_json=None)
        return await self._move(request_id, FutureState.COMPLETE, result_json=result, result_b64=None)

    async def fail(self, request_id: str, message: str, category: str = "server") -> FutureRecord:
        error = FutureError(message=message, category=category)  # type: ignore[arg-type]
        return await self._move(request_id, FutureState.FAILED, error=error)


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
