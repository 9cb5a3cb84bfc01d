"""Client sessions as the API sees them: ids in the SDK's formats, 404 for others' sessions, 410 once ended.

Records and their lifecycle (ACTIVE -> FINISHED | EXPIRED) live in `miles.state.records.SessionRepository`.
This adds the gateway's policy: a session silent for longer than `timeout_s` is expired, on sight and by
the gateway's periodic `sweep`, and a session that ends (finished or expired) hands its id to
`release_models`, so the runtime frees the LoRA adapters / full fine-tuning trainer its models hold.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from miles.errors import Category
from miles.gateway.errors import ApiError, not_found
from miles.state.records import SessionRecord, SessionRepository, SessionState

ReleaseModels = Callable[[str], Awaitable[None]]


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def inflight_target_id(model_id: str) -> str:
    """The record that points at a training model's latest inflight sampler save."""
    return f"{model_id}:inflight"


EPHEMERAL_PREFIX = "ephemeral:"


def ephemeral_snapshot_id(model_id: str, sampling_session_seq_id: int) -> str:
    """The id of an unnamed sampler save of a full fine-tuning model, which writes no files: shaped like
    the model's sampler paths, with a name no checkpoint can have (checkpoint names have no ':')."""
    return f"tinker://{model_id}/sampler_weights/{EPHEMERAL_PREFIX}{sampling_session_seq_id}"


def is_ephemeral_snapshot_id(path: str) -> bool:
    head, _, name = path.rpartition("/")
    in_sampler_weights = path.startswith("tinker://") and head.endswith("/sampler_weights")
    return in_sampler_weights and name.startswith(EPHEMERAL_PREFIX)


def session_of(model_or_sampler_id: str) -> str:
    return model_or_sampler_id.split(":", 1)[0]


class Sessions:
    def __init__(self, repo: SessionRepository, *, timeout_s: float, release_models: ReleaseModels) -> None:
        self.repo = repo
        self._timeout_s = timeout_s
        self._release_models = release_models

    async def create(self, tenant: str, *, tags: list[str], user_metadata: dict[str, Any]) -> str:
        session_id = f"sess-{uuid.uuid4().hex[:20]}"
        await self.repo.open(session_id, tenant, tags=tags, user_metadata=user_metadata)
        return session_id

    async def owned(self, tenant: str, session_id: str) -> SessionRecord:
        """The tenant's session (404 otherwise), expired first if it went silent for too long."""
        record = await self.repo.get_owned(tenant, session_id)
        if record is None:
            raise not_found(f"session {session_id!r}")
        if record.stale(self.repo.clock(), self._timeout_s):
            record = await self._expire(session_id) or record
        return record

    async def _expire(self, session_id: str) -> SessionRecord | None:
        record, expired_now = await self.repo.expire_if_stale(session_id, self._timeout_s)
        if expired_now:
            await self._release_models(session_id)
        return record

    async def require_active(self, tenant: str, session_id: str) -> SessionRecord:
        record = await self.owned(tenant, session_id)
        if not record.active:
            raise ApiError(
                Category.EXPIRED,
                f"session {session_id} is {record.state.value}; create a new session",
                kind="gone",
            )
        return record

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        await self.require_active(tenant, session_id)
        await self.repo.heartbeat(session_id)

    async def finish(self, tenant: str, session_id: str, reason: str | None) -> None:
        """Finish the session (200 again for an ended one) and release its models once."""
        await self.owned(tenant, session_id)
        _, ended_now = await self.repo.end(session_id, SessionState.FINISHED, reason)
        if ended_now:
            await self._release_models(session_id)

    async def sweep(self) -> list[str]:
        """Expire every session silent for longer than the timeout; the ids this call expired."""
        expired = []
        for record in await self.repo.stale_sessions(self._timeout_s):
            _, expired_now = await self.repo.expire_if_stale(record.session_id, self._timeout_s)
            if expired_now:
                await self._release_models(record.session_id)
                expired.append(record.session_id)
        return expired
