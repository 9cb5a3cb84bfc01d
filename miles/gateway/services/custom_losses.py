"""Server-side custom losses: create_custom_loss stores a checked program per session; a forward_backward
with loss_fn "custom" and loss_fn_config {"loss_id"} gets it back to send to the trainer.

The gateway checks the graph (miles.contract.custom_loss) before storing it, so a refusal reaches the SDK's
create_custom_loss call itself; the trainer rebuilds it from its own table and checks it against every batch.
A loss belongs to the session that created it: other sessions, and other tenants, cannot run it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tinker import types as tt

from miles.contract.custom_loss import CustomLossRefused, program_from_request
from miles.errors import UserError
from miles.gateway.operations import Operations
from miles.gateway.sessions import Sessions
from miles.gateway.tinker.responses import sdk_json
from miles.state.records import Clock, CustomLossRecord, CustomLossRepository, ModelRecord


def custom_loss_id(session_id: str, custom_loss_seq_id: int) -> str:
    return f"{session_id}:loss:{custom_loss_seq_id}"


class CustomLosses:
    def __init__(
        self, repo: CustomLossRepository, sessions: Sessions, ops: Operations, *, clock: Clock = time.time
    ) -> None:
        self._repo = repo
        self._sessions = sessions
        self._ops = ops
        self._clock = clock

    async def create(
        self,
        tenant: str,
        session_id: str,
        custom_loss_seq_id: int,
        name: str,
        inputs: Sequence[Mapping[str, Any]],
        graph: Mapping[str, Any],
        key: str | None,
    ) -> str:
        """The request id of a future answering CreateCustomLossResponse; UserError naming what is refused."""
        await self._sessions.require_active(tenant, session_id)
        try:
            program = program_from_request(name, inputs, graph)
        except CustomLossRefused as exc:
            raise UserError(f"create_custom_loss refused: {exc}") from exc
        loss_id = custom_loss_id(session_id, custom_loss_seq_id)
        record = CustomLossRecord(
            loss_id=loss_id,
            tenant=tenant,
            session_id=session_id,
            program=program.model_dump(mode="json"),
            created_at=self._clock(),
        )
        if not await self._repo.create(record):
            existing = await self._repo.get(loss_id)
            if existing is None or existing.program != record.program:  # a retry sends the same program
                raise UserError(
                    f"custom_loss_seq_id {custom_loss_seq_id} of session {session_id} already names another "
                    "loss; a session numbers its losses 0, 1, 2, ..."
                )

        async def answer() -> dict[str, Any]:
            return sdk_json(tt.CreateCustomLossResponse(loss_id=loss_id))

        request_id, _ = await self._ops.submit_concurrent(
            tenant=tenant,
            kind="CreateCustomLoss",
            model_id=None,
            dedup=f"custom_loss:{loss_id}",
            idempotency_key=key,
            operation=answer,
            slots=contextlib.nullcontext(),
        )
        return request_id

    async def program_for(
        self, tenant: str, model: ModelRecord, loss_config: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The stored program a forward_backward of `model` names by loss_fn_config {"loss_id"}."""
        loss_id = loss_config.get("loss_id")
        if set(loss_config) != {"loss_id"} or not isinstance(loss_id, str):
            raise UserError(
                "loss_fn 'custom' takes loss_fn_config {'loss_id': <id from create_custom_loss>} and nothing "
                f"else, got keys {sorted(loss_config)}"
            )
        record = await self._repo.get_owned(tenant, loss_id)
        if record is None:
            raise UserError(f"no custom loss {loss_id!r} here; create it with create_custom_loss first")
        if record.session_id != model.session_id:
            raise UserError(
                f"custom loss {loss_id!r} belongs to session {record.session_id}, model {model.model_id} to "
                f"session {model.session_id}; a loss runs only for the session that created it"
            )
        return record.program

    async def forget_session(self, session_id: str) -> None:
        """A session ended: its losses can no longer run."""
        for record in await self._repo.list(prefix=f"{session_id}:loss:"):
            if record.session_id == session_id:
                await self._repo.delete(record.loss_id)
