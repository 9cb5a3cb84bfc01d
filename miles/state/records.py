"""Typed records over a StateStore, so callers never spell dict keys by hand: sessions, models, samplers
and checkpoints here; futures in `miles.state.futures`, dedup claims in `miles.state.claims`.

Each repository owns one namespace. Reads for a tenant (`get_owned`) answer None for another tenant's
record, so "not yours" and "not there" look the same to callers (both become 404).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from miles.errors import IllegalTransition
from miles.state.store import JsonDict, StateStore, StateStoreError

Clock = Callable[[], float]
S = TypeVar("S", bound=StrEnum)


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
            "base_model": self.base_model,  # tinker 0.39's Checkpoint.base_model
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
    max_context: int | None = None  # created as `<base>:peft:<context>`: its data must fit that context
    copied_from: str | None = None  # made by copy_weights to hold a copy of this checkpoint: never trained


class SamplerRecord(Record):
    sampling_session_id: str
    tenant: str
    base_model: str
    created_at: float
    session_id: str | None = None
    model_id: str | None = None
    model_path: str | None = None  # tinker://... sampler path, None for a base-model sampler
    # an unnamed save of a full fine-tuning model: the id of the weights pushed at the save (no files,
    # so model_path is None); the runtime serves it until the trainer moves, then refuses it as stale
    ephemeral_snapshot: str | None = None
    # kind="inflight": samples from its model's latest inflight save (the record at inflight_target_id)
    inflight: bool = False


def check_transition(table: Mapping[S, frozenset[S]], current: S, target: S) -> None:
    """Refuse a move `table` does not allow (terminal states have no way out): the one check of every
    lifecycle (SESSION_TRANSITIONS here, FUTURE_TRANSITIONS in miles.state.futures)."""
    if target not in table[current]:
        what = type(current).__name__.removesuffix("State").lower()
        raise IllegalTransition(f"{what} cannot go from {current.value} to {target.value}")


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
        check_transition(SESSION_TRANSITIONS, SessionState.ACTIVE, target)
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


class CustomLossRecord(Record):
    """A custom loss a session stored with create_custom_loss: the checked program, run by its loss_id."""

    loss_id: str
    tenant: str
    session_id: str
    program: dict[str, Any]  # miles.contract.custom_loss.CustomLossProgram, as JSON
    created_at: float


class CustomLossRepository(Repository[CustomLossRecord]):
    namespace = "custom_losses"
    record_type = CustomLossRecord
    id_field = "loss_id"
