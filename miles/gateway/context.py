"""Everything a route needs, built once per app and reached through `request.app.state.gateway`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from miles.gateway.auth import ApiKeys, bearer_token
from miles.gateway.errors import ApiError, bad_request
from miles.gateway.futures import FutureRegistry
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.registry import ModelRegistry, SamplerRegistry
from miles.gateway.runtime import ModelCard, Runtime
from miles.gateway.sessions import Sessions
from miles.gateway.settings import GatewaySettings
from miles.state import StateStore


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
        self.futures = FutureRegistry(self.store, ttl_s=self.settings.future_ttl_s)
        self.ops = Operations(self.store, self.futures, self.settings, self.metrics)
        self.sessions = Sessions(self.store, timeout_s=self.settings.session_timeout_s)
        self.models = ModelRegistry(self.store)
        self.samplers = SamplerRegistry(self.store)

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
