"""Health (`/health`, `/api/v1/healthz`) and Prometheus metrics (`/metrics`); open without a key.

503 means the runtime is dead (no alive trainer cell): the job's watchdog ends the job after a few of
them. A state store that does not answer is not that: training state lives in the trainer, the store
comes back (a Redis restart, a network blip) and requests are answered 503 meanwhile, so healthz stays
200 and says `"status": "degraded"` with the store's problem. Ending a 10-hour run over a Redis blip
would lose more than the blip does; a store that stays down is the operator's to fix. Likewise a runtime
that serves only in part (an engine failed and respawning, colocated GPUs left unsettled by a failed
switch) answers 200 "degraded" with `runtime`: what happened, for the operator.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from miles.gateway.context import gateway_of
from miles.seam.runtime import degradation_of
from miles.state import StateStore, StateStoreError

router = APIRouter()

# A probe answers quickly even while the store hangs (the watchdog's probe has its own timeout).
STORE_PROBE_TIMEOUT_S = 2.0


async def state_store_problem(store: StateStore) -> str | None:
    """None when the store answers a ping within STORE_PROBE_TIMEOUT_S, else what is wrong."""
    try:
        async with asyncio.timeout(STORE_PROBE_TIMEOUT_S):
            await store.ping()
    except TimeoutError:
        return f"the state store did not answer within {STORE_PROBE_TIMEOUT_S:g} s"
    except StateStoreError as exc:
        return exc.public_message()
    return None


@router.get("/health")
@router.get("/api/v1/healthz")
async def healthz(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    problem = gw.runtime.health_problem()
    gw.metrics.healthy.set(0 if problem else 1)
    if problem is not None:
        return JSONResponse(status_code=503, content={"status": "unavailable", "error": problem})
    degraded: dict[str, str] = {}
    if (store_problem := await state_store_problem(gw.store)) is not None:
        degraded["state_store"] = store_problem
    if (runtime_problem := degradation_of(gw.runtime)) is not None:
        degraded["runtime"] = runtime_problem
    if degraded:
        return JSONResponse(content={"status": "degraded", **degraded})
    return JSONResponse(content={"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    gw.metrics.pending_futures.set(gw.futures.pending_count())
    return Response(content=gw.metrics.render(), media_type=gw.metrics.content_type)
