"""Everything a route needs, built once per app and reached through `request.app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from miles.gateway.auth import ApiKeys, bearer_token
from miles.gateway.errors import ApiError, bad_request, not_found
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.sessions import Sessions
from miles.gateway.settings import GatewaySettings
from miles.runtime.api import ModelCard, Runtime
from miles.state import StateStore
from miles.state.records import (
    DedupClaims,
    FutureRepository,
    ModelRecord,
    ModelRepository,
    SamplerRecord,
    SamplerRepository,
    SessionRepository,
)

log = logging.getLogger(__name__)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass
class Gateway:
    runtime: Runtime
    store: StateStore
    checkpoints: Any  # miles.checkpoints.manager.CheckpointManager
    auth: ApiKeys
    settings: GatewaySettings
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)

    def __post_init__(self) -> None:
        self.futures = FutureRepository(self.store, ttl_s=self.settings.future_ttl_s)
        self.ops = Operations(self.futures, DedupClaims(self.store), self.settings, self.metrics)
        self.models = ModelRepository(self.store)  # the CheckpointManager updates the same records
        self.samplers = SamplerRepository(self.store)
        self.sessions = Sessions(
            SessionRepository(self.store),
            timeout_s=self.settings.session_timeout_s,
            release_models=self.release_session_models,
        )

    async def owned_model(self, tenant: str, model_id: str) -> ModelRecord:
        model = await self.models.get_owned(tenant, model_id)
        if model is None:
            raise not_found(f"model {model_id!r}")
        return model

    async def owned_sampler(self, tenant: str, sampler_id: str) -> SamplerRecord:
        sampler = await self.samplers.get_owned(tenant, sampler_id)
        if sampler is None:
            raise not_found(f"sampler {sampler_id!r}")
        return sampler

    async def release_session_models(self, session_id: str) -> None:
        """A session ended: its queued operations are refused and the runtime frees its models."""
        reason = f"session {session_id} has ended; its models were released"
        for model in await self.models.list(prefix=f"{session_id}:"):
            if model.session_id == session_id:
                self.ops.release_model(model.model_id, reason, self.runtime.release_model)

    async def sweep_sessions_forever(self) -> None:
        """Expire silent sessions every `session_sweep_s` (a client that vanished never finishes)."""
        while True:
            await asyncio.sleep(self.settings.session_sweep_s)
            try:
                await self.sessions.sweep()
            except Exception:
                log.exception("session sweep failed; trying again in %.0f s", self.settings.session_sweep_s)

    @contextlib.asynccontextmanager
    async def background(self):
        """The gateway's own background work (the session sweep) for the app's lifetime."""
        sweeper = asyncio.create_task(self.sweep_sessions_forever(), name="session-sweep")
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper

    def cards(self) -> dict[str, ModelCard]:
        return {card.name: card for card in self.runtime.model_cards()}

    def card(self, base_model: str, *, for_training: bool = False) -> ModelCard:
        cards = self.cards()
        card = cards.get(base_model)
        if card is None:
            known = ", ".join(sorted(cards)) or "none"
            raise bad_request(f"unknown base_model {base_model!r}; this server has: {known}")
        if for_training and not card.trainable:
            raise bad_request(f"base_model {base_model!r} is served for sampling only")
        return card


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def tinker_tenant(request: Request) -> str:
    tenant = gateway_of(request).auth.tenant_for(request.headers.get("x-api-key"))
    if tenant is None:
        raise ApiError(401, "missing or unknown API key: send it in the X-API-Key header", kind="auth_error")
    return tenant


def openai_tenant(request: Request) -> str:
    gw = gateway_of(request)
    tenant = gw.auth.tenant_for(bearer_token(request.headers.get("authorization")))
    if tenant is None:
        raise ApiError(
            401, "missing or unknown API key: send 'Authorization: Bearer <key>'", kind="invalid_api_key"
        )
    return tenant
