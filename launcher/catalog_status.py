"""`launcher status RUN`'s catalog table: read from the gateway's GET /api/v1/catalog, rendered as rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from rich.table import Table

from miles.contract.tls import pinned_tls

CATALOG_PATH = "/api/v1/catalog"
CATALOG_TIMEOUT_S = 5.0
COLUMNS = ("model", "instance", "epoch", "state", "node", "gpus", "tenants", "idle s")


def fetch_catalog(gateway_url: str, api_key: str | None, tls_cert: Path | None) -> dict[str, Any]:
    """{"snapshot": ...} from the gateway, or {"error": why} (no key, no answer, an error status)."""
    if not api_key:
        return {"error": "no API key to authenticate with (the run's key file or variable is missing)"}
    try:
        verify = pinned_tls(tls_cert) if tls_cert is not None else True
        response = httpx.get(  # never through http_proxy, as the healthz probe
            gateway_url + CATALOG_PATH,
            headers={"X-API-Key": api_key},
            timeout=CATALOG_TIMEOUT_S,
            trust_env=False,
            verify=verify,
        )
    except (httpx.HTTPError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text.strip()[:300]}"}
    return {"snapshot": response.json()}


def catalog_rows(snapshot: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per instance; a model without instances gets one row saying so (resident or on demand)."""
    rows: list[tuple[str, ...]] = []
    for model in snapshot.get("models", []):
        if not model.get("instances"):
            idle = "resident" if model.get("resident") else "on demand: none started"
            rows.append((model["name"], "-", "-", idle, "-", "-", "0", "-"))
        for inst in model.get("instances", []):
            tenants = ", ".join(f"{t['model_id']} ({t['train_mode']})" for t in inst["tenants"]) or "0"
            rows.append(
                (
                    model["name"],
                    inst["instance_id"],
                    str(inst["epoch"]),
                    inst["state"] + (f": {inst['cause']}" if inst.get("cause") else ""),
                    inst["node"],
                    str(inst["gpus"]),
                    tenants,
                    f"{inst['idle_s']:.0f}",
                )
            )
    return rows


def pool_line(snapshot: dict[str, Any]) -> str:
    pool = snapshot.get("pool")
    if not pool:
        return "pool: fixed at bring-up (no catalog)"
    nodes = ", ".join(f"{n['node']} {n['free']}/{n['gpus']}" for n in pool["nodes"])
    return f"free GPUs: {pool['free_gpus']} of {pool['total_gpus']} ({nodes}); handles: {snapshot['handles']}"


def catalog_table(snapshot: dict[str, Any]) -> Table:
    table = Table(*COLUMNS, title="catalog", caption=pool_line(snapshot))
    for row in catalog_rows(snapshot):
        table.add_row(*row)
    return table
