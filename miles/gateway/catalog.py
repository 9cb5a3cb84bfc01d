"""`GET /api/v1/catalog` (authenticated): the model catalog's models, instances, tenants and free pool.

A runtime with a catalog answers its snapshot (Runtime.catalog()); one without (a job serving one model
fixed at bring-up) answers its models as resident entries with no pool to show. With elastic training on,
`elastic` adds its lanes and GPU owners (`launcher status` shows them).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from miles.errors import Category
from miles.gateway.auth import bearer_token
from miles.gateway.context import gateway_of
from miles.gateway.errors import ApiError
from miles.seam.runtime import Runtime, catalog_of, elastic_of

router = APIRouter(prefix="/api/v1")


def _tenant(request: Request) -> str:
    """Either header a client of this gateway sends: X-API-Key (tinker) or a bearer token (OpenAI)."""
    gw = gateway_of(request)
    key = request.headers.get("x-api-key") or bearer_token(request.headers.get("authorization"))
    tenant = gw.auth.tenant_for(key)
    if tenant is None:
        raise ApiError(
            Category.UNAUTHORIZED, "missing or unknown API key: send it in X-API-Key or Authorization: Bearer"
        )
    return tenant


@router.get("/catalog")
async def catalog(request: Request) -> dict[str, Any]:
    _tenant(request)
    runtime = gateway_of(request).runtime
    snapshot = catalog_of(runtime) or fixed_catalog(runtime)
    elastic = elastic_of(runtime)  # lanes and GPU owners, in a job with elastic.enabled
    return snapshot if elastic is None else {**snapshot, "elastic": elastic}


def fixed_catalog(runtime: Runtime) -> dict[str, Any]:
    """A runtime without a catalog: its models, resident, with no instance or pool bookkeeping."""
    models = [
        {
            "name": card.name,
            "train_modes": [card.train_mode] if card.trainable else [],
            "resident": True,
            "instances": [],
        }
        for card in runtime.model_cards()
    ]
    return {"models": models, "pool": None, "handles": None}
