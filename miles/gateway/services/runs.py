"""RunsService: training runs and sessions as the REST API lists them, answered from state.

access_scope "owned" (the SDK's default) is the caller's own; "accessible" adds the training runs of
other tenants that have a published checkpoint (what a published tinker path lets the caller read).
Sessions are listed newest first; a session's training runs and samplers come from their records.
"""

from __future__ import annotations

from typing import Literal

from miles.checkpoints.manager import CheckpointManager
from miles.gateway.errors import not_found
from miles.gateway.sessions import inflight_target_id
from miles.state.records import ModelRecord, ModelRepository, SamplerRepository, SessionRepository

AccessScope = Literal["owned", "accessible"]


class RunsService:
    def __init__(
        self,
        models: ModelRepository,
        samplers: SamplerRepository,
        sessions: SessionRepository,
        checkpoints: CheckpointManager,
    ) -> None:
        self._models = models
        self._samplers = samplers
        self._sessions = sessions
        self._checkpoints = checkpoints

    async def training_run(self, tenant: str, model_id: str, access_scope: AccessScope) -> ModelRecord:
        model = await self._models.get(model_id)
        if model is not None and model.tenant == tenant:
            return model
        readable = access_scope == "accessible" and await self._checkpoints.has_public(model_id)
        if model is not None and readable:
            return model
        raise not_found(f"training run {model_id!r}")

    async def session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        records = await self._sessions.list(tenant=tenant)
        newest_first = sorted(records, key=lambda r: (r.created_at, r.session_id), reverse=True)
        return [r.session_id for r in newest_first[offset : offset + limit]]

    async def session(self, tenant: str, session_id: str) -> dict:
        """The SDK's GetSessionResponse: the session's training runs and samplers, oldest first."""
        record = await self._sessions.get_owned(tenant, session_id)
        if record is None:
            raise not_found(f"session {session_id!r}")
        prefix = f"{session_id}:"
        models = await self._models.list(tenant=tenant, prefix=prefix)
        models = [m for m in models if m.session_id == session_id]
        samplers = [
            s
            for s in await self._samplers.list(tenant=tenant, prefix=prefix)
            # the inflight pointer record of a model is no sampler a client opened
            if s.session_id == session_id and s.sampling_session_id != inflight_target_id(s.model_id or "")
        ]
        return {
            "training_run_ids": [m.model_id for m in sorted(models, key=lambda m: m.created_at)],
            "sampler_ids": [s.sampling_session_id for s in sorted(samplers, key=lambda s: s.created_at)],
            "user_metadata": {str(k): str(v) for k, v in record.user_metadata.items()} or None,
        }
