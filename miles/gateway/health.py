"""Health (`/health`, `/api/v1/healthz`) and Prometheus metrics (`/metrics`); open without a key."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from miles.gateway.context import gateway_of

router = APIRouter()


@router.get("/health")
@router.get("/api/v1/healthz")
async def healthz(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    problem = gw.runtime.health_problem()
    gw.metrics.healthy.set(0 if problem else 1)
    if problem is not None:
        return JSONResponse(status_code=503, content={"status": "unavailable", "error": problem})
    return JSONResponse(content={"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    gw.metrics.pending_futures.set(gw.futures.pending_count())
    return Response(content=gw.metrics.render(), media_type=gw.metrics.content_type)
