"""The FastAPI app factory: Tinker, OpenAI, health and metrics routers over one `Runtime`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from miles.checkpoints.manager import CheckpointManager
from miles.errors import MilesError
from miles.gateway.auth import ApiKeys
from miles.gateway.body_limit import BodySizeLimit
from miles.gateway.catalog import router as catalog_router
from miles.gateway.context import Gateway
from miles.gateway.errors import answer_for, extras_for
from miles.gateway.health import router as health_router
from miles.gateway.openai.routes import HOSTED_PREFIX, OPENAI_PREFIXES
from miles.gateway.openai.routes import router as openai_router
from miles.gateway.request_counter import CountRequests
from miles.gateway.request_log import RequestLog
from miles.gateway.sdk_version import SdkVersionWindow
from miles.gateway.services.uploads import PUT_PREFIX as UPLOAD_PUT_PREFIX
from miles.gateway.settings import GatewaySettings
from miles.gateway.tinker.refusals import RefusedSeqIds
from miles.gateway.tinker.routes_core import router as tinker_core_router
from miles.gateway.tinker.routes_rest import router as tinker_rest_router
from miles.gateway.tinker.routes_sampling import router as tinker_sampling_router
from miles.gateway.tinker.routes_training import router as tinker_training_router
from miles.gateway.tinker.routes_unsupported import router as tinker_unsupported_router
from miles.gateway.tinker.routes_uploads import router as tinker_uploads_router
from miles.seam.runtime import Runtime, watch_training_queue
from miles.state import StateStore

log = logging.getLogger(__name__)
# how long a stopping gateway waits for the sampler snapshots still being written behind their saves
CHECKPOINT_DRAIN_S = 120.0


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith(OPENAI_PREFIXES)


def error_response(
    request: Request, status: int, message: str, kind: str, exc: MilesError | None = None
) -> JSONResponse:
    body: dict[str, Any]
    if _is_openai(request):
        body = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    else:
        body = {"detail": message, "type": kind}
    details, headers = extras_for(exc)
    if details is not None:
        body["details"] = details
    return JSONResponse(status_code=status, content=body, headers=headers)


async def refuse(scope: Scope, receive: Receive, send: Send, error: MilesError) -> None:
    """Answer `error` from ASGI middleware, in the same style as the app's exception handlers."""
    response = error_response(Request(scope, receive), *answer_for(error))
    await response(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MilesError)
    async def miles_error(request: Request, exc: MilesError) -> JSONResponse:
        return error_response(request, *answer_for(exc), exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()[:5]
        )
        return error_response(request, 400, f"invalid request: {problems}", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(request, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}", "server_error")


def create_app(
    runtime: Runtime,
    store: StateStore,
    checkpoints: CheckpointManager,
    auth: ApiKeys,
    settings: GatewaySettings | None = None,
    *,
    owns_runtime: bool = False,
) -> FastAPI:
    """The gateway app. `owns_runtime`: close the runtime when the app shuts down (entry points)."""
    gateway = Gateway(runtime, store, checkpoints, auth, settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with gateway.background():
            yield
        await gateway.ops.close()
        # snapshots written behind their saves: the trainer writes them, so before the runtime closes
        if cancelled := await checkpoints.drain(CHECKPOINT_DRAIN_S):
            log.error("%d checkpoint(s) still being written at shutdown were not kept", cancelled)
        if owns_runtime:
            # Here, not after serve(): uvicorn re-raises SIGTERM when serve() returns.
            await runtime.close()

    app = FastAPI(title="miles gateway", lifespan=lifespan)
    app.state.gateway = gateway
    watch_training_queue(runtime, gateway.ops.training_waiting)
    _install_error_handlers(app)

    app.add_middleware(CountRequests, metrics=gateway.metrics)

    async def account_refused(api_key: str | None, model_id: str, seq_id: int) -> bool:
        tenant = gateway.auth.tenant_for(api_key)
        return tenant is not None and await gateway.training.account_refused(tenant, model_id, seq_id)

    app.add_middleware(RefusedSeqIds, account=account_refused, max_body_bytes=gateway.settings.max_body_bytes)
    app.add_middleware(SdkVersionWindow, refuse=refuse)
    if gateway.settings.request_log_path:
        app.add_middleware(RequestLog, path=Path(gateway.settings.request_log_path))
    # outermost: nothing (the request log, the refusal accounting, the routes) reads an oversized body
    app.add_middleware(
        BodySizeLimit, max_bytes=gateway.settings.max_body_bytes, refuse=refuse, streamed=(UPLOAD_PUT_PREFIX,)
    )
    for router in (
        health_router,
        catalog_router,
        tinker_core_router,
        tinker_training_router,
        tinker_sampling_router,
        tinker_rest_router,
        tinker_uploads_router,
        tinker_unsupported_router,
        openai_router,
    ):
        app.include_router(router)
    app.include_router(openai_router, prefix=HOSTED_PREFIX)
    return app
