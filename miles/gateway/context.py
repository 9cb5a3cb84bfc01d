"""Everything a route needs, built once per app and reached through `request.app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field

from fastapi import Request

from miles.checkpoints.manager import CheckpointManager
from miles.errors import Category
from miles.gateway.auth import ApiKeys, bearer_token
from miles.gateway.errors import ApiError
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.services.base_models import BaseModels
from miles.gateway.services.checkpoints import CheckpointService
from miles.gateway.services.custom_losses import CustomLosses
from miles.gateway.services.runs import RunsService
from miles.gateway.services.sampling import SamplingService
from miles.gateway.services.storage import StorageWatch
from miles.gateway.services.trace_export import TraceExport
from miles.gateway.services.training import TrainingService
from miles.gateway.services.uploads import UploadService
from miles.gateway.sessions import Sessions
from miles.gateway.settings import GatewaySettings
from miles.gateway.trace_otel import OtelExport
from miles.seam.runtime import Runtime, report_operation_timeout
from miles.state import StateStore
from miles.state.claims import DedupClaims
from miles.state.futures import FutureRepository
from miles.state.records import CustomLossRepository, ModelRepository, SamplerRepository, SessionRepository

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    runtime: Runtime
    store: StateStore
    checkpoints: CheckpointManager
    auth: ApiKeys
    settings: GatewaySettings
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)

    def __post_init__(self) -> None:
        self.futures = FutureRepository(self.store, ttl_s=self.settings.future_ttl_s)
        self.ops = Operations(
            self.futures,
            DedupClaims(self.store),
            self.settings,
            self.metrics,
            on_timeout=functools.partial(report_operation_timeout, self.runtime),
        )
        self.models = ModelRepository(self.store)  # the CheckpointManager updates the same records
        self.samplers = SamplerRepository(self.store)
        self.sessions = Sessions(
            SessionRepository(self.store),
            timeout_s=self.settings.session_timeout_s,
            release_models=self.release_session_models,
        )
        self.base_models = BaseModels(self.runtime)
        self.custom_losses = CustomLosses(CustomLossRepository(self.store), self.sessions, self.ops)
        self.training = TrainingService(
            self.runtime,
            self.base_models,
            self.models,
            self.samplers,
            self.sessions,
            self.checkpoints,
            self.ops,
            self.custom_losses,
        )
        self.checkpoint_service = CheckpointService(self.checkpoints)
        self.uploads = UploadService(self.checkpoints, self.models, self.base_models)
        self.trace_export = TraceExport(self.ops.traces, self.sessions)
        self.otel: OtelExport | None = None
        if self.settings.otel_endpoint:
            self.otel = self.ops.traces.sink = OtelExport(self.settings.otel_endpoint)
        self.storage = StorageWatch(
            self.checkpoints.root, self.metrics, self.settings.checkpoint_fs_warn_fraction
        )
        self.runs = RunsService(self.models, self.samplers, self.sessions.repo, self.checkpoints)
        self.sampling = SamplingService(
            self.runtime,
            self.base_models,
            self.checkpoints,
            self.samplers,
            self.sessions,
            self.ops,
            self.settings,
        )

    async def release_session_models(self, session_id: str) -> None:
        """A session ended: its queued operations are refused and the runtime frees its models."""
        reason = f"session {session_id} has ended; its models were released"
        await self.custom_losses.forget_session(session_id)
        for model in await self.models.list(prefix=f"{session_id}:"):
            if model.session_id == session_id:
                self.ops.release_model(model.model_id, reason, self.runtime.release_model)

    async def sweep_forever(self) -> None:
        """Every `session_sweep_s`: expire silent sessions (a client that vanished never finishes) and
        delete checkpoints whose TTL has passed."""
        sweeps = (
            ("session", self.sessions.sweep),
            ("checkpoint TTL", self.sweep_expired_checkpoints),
            ("checkpoint storage", self.check_storage),
        )
        while True:
            await asyncio.sleep(self.settings.session_sweep_s)
            for what, sweep in sweeps:
                try:
                    await sweep()
                except Exception:
                    log.exception(
                        "%s sweep failed; trying again in %.0f s", what, self.settings.session_sweep_s
                    )

    async def check_storage(self) -> None:
        await asyncio.to_thread(self.storage.check)

    async def sweep_expired_checkpoints(self) -> list[str]:
        """Expired checkpoints go, except a snapshot an open sampler of an active session samples from (its
        engines may load it again) and those being read now (pinned by the services)."""
        active: dict[str, bool] = {}
        in_use = set()
        for sampler in await self.samplers.list():
            if sampler.model_path is None or sampler.session_id is None:
                continue
            if sampler.session_id not in active:
                session = await self.sessions.repo.get(sampler.session_id)
                active[sampler.session_id] = session is not None and session.active
            if active[sampler.session_id]:
                in_use.add(sampler.model_path)
        return await self.checkpoints.sweep_expired(in_use)

    @contextlib.asynccontextmanager
    async def background(self):
        """The gateway's own background work for the app's lifetime. First, checkpoints on disk that the
        store does not know (a memory store after a restart) are indexed, so listings show them."""
        added = await self.checkpoints.reindex_from_disk()
        if added:
            log.info("indexed %d checkpoint(s) found on disk", added)
        await self.check_storage()  # the gauges from the start, not after the first sweep
        sweeper = asyncio.create_task(self.sweep_forever(), name="gateway-sweep")
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            if self.otel is not None:
                await asyncio.to_thread(self.otel.close)  # sends what is buffered


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


# The tenant dependencies are coroutines: FastAPI runs a plain-function dependency on its thread pool, a
# hand-off to a worker thread and back on every request (issue 24). They do no blocking work.
async def tinker_tenant(request: Request) -> str:
    tenant = gateway_of(request).auth.tenant_for(request.headers.get("x-api-key"))
    if tenant is None:
        raise ApiError(Category.UNAUTHORIZED, "missing or unknown API key: send it in the X-API-Key header")
    return tenant


async def openai_tenant(request: Request) -> str:
    gw = gateway_of(request)
    tenant = gw.auth.tenant_for(bearer_token(request.headers.get("authorization")))
    if tenant is None:
        raise ApiError(
            Category.UNAUTHORIZED,
            "missing or unknown API key: send 'Authorization: Bearer <key>'",
            kind="invalid_api_key",
        )
    return tenant
