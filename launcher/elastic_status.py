"""`launcher status RUN`'s elastic table: each engine's GPUs, their owner (engine, hybrid lane or free)
and its loan state, from the `elastic` part of the gateway's GET /api/v1/catalog (docs/elastic.md)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

COLUMNS = ("gpu", "owner")


def elastic_rows(elastic: dict[str, Any]) -> list[tuple[str, str]]:
    return [(gpu, owner) for gpu, owner in elastic.get("owners", {}).items()]


def elastic_caption(elastic: dict[str, Any]) -> str:
    engines = ", ".join(f"{name}: {state}" for name, state in elastic.get("engines", {}).items())
    lanes = ", ".join(elastic.get("lanes", [])) or "none"
    caption = f"lanes (epoch {elastic.get('epoch')}): {lanes}; engines: {engines or 'none'}"
    if elastic.get("shortfalls"):
        caption += f"; not freed: {'; '.join(elastic['shortfalls'])}"
    return caption


def elastic_table(elastic: dict[str, Any]) -> Table:
    table = Table(*COLUMNS, title="elastic: GPU owners", caption=elastic_caption(elastic))
    for row in elastic_rows(elastic):
        table.add_row(*row)
    return table
