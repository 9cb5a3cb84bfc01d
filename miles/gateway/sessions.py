"""Client sessions: create, heartbeat, finish, expiry; ids in the formats the SDK computes."""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any

from miles.gateway.errors import ApiError, not_found
from miles.state import StateStore

NAMESPACE = "gw.sessions"


class SessionStatus(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    EXPIRED = "expired"


# A finished or expired session never comes back.
ALLOWED_TRANSITIONS: dict[SessionStatus, frozenset[SessionStatus]] = {
    SessionStatus.ACTIVE: frozenset({SessionStatus.FINISHED, SessionStatus.EXPIRED}),
    SessionStatus.FINISHED: frozenset(),
    SessionStatus.EXPIRED: frozenset(),
}


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def session_of(model_or_sampler_id: str) -> str:
    return model_or_sampler_id.split(":", 1)[0]


class Sessions:
    def __init__(self, store: StateStore, *, timeout_s: float, clock=time.time) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._clock = clock

    async def create(self, tenant: str, *, tags: list[str], user_metadata: dict[str, Any]) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:20]}"
        now = self._clock()
        record = {
            "tenant": tenant,
            "status": SessionStatus.ACTIVE.value,
            "created_at": now,
            "last_heartbeat": now,
            "tags": list(tags),
            "user_metadata": dict(user_metadata),
        }
        await self._store.put(NAMESPACE, session_id, record)
        return session_id

    async def _read(self, tenant: str, session_id: str) -> dict[str, Any]:
        rec = await self._store.get(NAMESPACE, session_id)
        if rec is None or rec.get("tenant") != tenant:
            raise not_found(f"session {session_id!r}")
        if rec["status"] == SessionStatus.ACTIVE and self._clock() - rec["last_heartbeat"] > self._timeout_s:
            rec = await self._move(session_id, SessionStatus.EXPIRED)
        return rec

    async def _move(self, session_id: str, target: SessionStatus) -> dict[str, Any]:
        def apply(current: dict[str, Any] | None) -> dict[str, Any] | None:
            if current is None:
                return None
            status = SessionStatus(current["status"])
            if status == target or target not in ALLOWED_TRANSITIONS[status]:
                return current
            return {**current, "status": target.value, "ended_at": self._clock()}

        rec = await self._store.update(NAMESPACE, session_id, apply)
        if rec is None:
            raise not_found(f"session {session_id!r}")
        return rec

    async def require_active(self, tenant: str, session_id: str) -> dict[str, Any]:
        rec = await self._read(tenant, session_id)
        if rec["status"] != SessionStatus.ACTIVE:
            raise ApiError(410, f"session {session_id} is {rec['status']}; create a new session", kind="gone")
        return rec

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        await self.require_active(tenant, session_id)
        now = self._clock()

        def beat(current: dict[str, Any] | None) -> dict[str, Any] | None:
            if current is None or current["status"] != SessionStatus.ACTIVE:
                return current
            return {**current, "last_heartbeat": now}

        await self._store.update(NAMESPACE, session_id, beat)

    async def finish(self, tenant: str, session_id: str, reason: str | None) -> None:
        await self._read(tenant, session_id)
        await self._move(session_id, SessionStatus.FINISHED)

        def note(current: dict[str, Any] | None) -> dict[str, Any] | None:
            return None if current is None else {**current, "finish_reason": reason}

        await self._store.update(NAMESPACE, session_id, note)
