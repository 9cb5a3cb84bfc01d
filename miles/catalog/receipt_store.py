"""Receipts of ended handles in the job's StateStore, so a restarted gateway still answers an operation on
an ended handle with why it ended ("expired: idle ...") instead of "not found".

Bounded as the in-memory log is, in number and age: each receipt is one key that expires after `max_age_s`
(the store drops it; no sweep needed), and one index document lists the kept receipts newest last, capped
at `max_count`; a receipt pushed out of the index has its key deleted. Only the catalog controller writes
them (it is the single writer of allocation state), after the change that made them, under its persist lock.
"""

from __future__ import annotations

from typing import Any

from miles.catalog.receipts import Receipt
from miles.state import StateStore

RECEIPTS_NS = "catalog-receipts"
INDEX_NS, INDEX_KEY = "catalog", "receipt-index"


class StoredReceipts:
    def __init__(self, store: StateStore, *, max_count: int, max_age_s: float) -> None:
        self._store = store
        self.max_count = max_count
        self.max_age_s = max_age_s

    async def save(self, receipts: list[Receipt]) -> None:
        """Write `receipts` (oldest first) and drop whatever the bounds push out."""
        if not receipts:
            return
        for receipt in receipts:
            value = {"reason": receipt.reason, "detail": receipt.detail, "at": receipt.at}
            await self._store.put(RECEIPTS_NS, receipt.model_id, value, ttl_s=self.max_age_s)
        dropped: list[str] = []

        def add(index: dict[str, Any] | None) -> dict[str, Any]:
            kept, pushed_out = bounded_index(
                (index or {}).get("order", []), receipts, max_count=self.max_count, max_age_s=self.max_age_s
            )
            dropped[:] = pushed_out  # the store may call this more than once
            return {"order": kept}

        await self._store.update(INDEX_NS, INDEX_KEY, add)
        for model_id in dropped:
            await self._store.delete(RECEIPTS_NS, model_id)

    async def load(self, now: float) -> list[Receipt]:
        """The kept receipts, oldest first (a key the store already expired is skipped)."""
        index = await self._store.get(INDEX_NS, INDEX_KEY)
        order = [model_id for model_id, at in (index or {}).get("order", []) if now - at < self.max_age_s]
        stored = dict(await self._store.list(RECEIPTS_NS))
        return [
            Receipt(model_id, value["reason"], value["detail"], float(value["at"]))
            for model_id in order
            if (value := stored.get(model_id)) is not None
        ]


def bounded_index(
    order: list[list[Any]], added: list[Receipt], *, max_count: int, max_age_s: float
) -> tuple[list[list[Any]], list[str]]:
    """Pure: the index ([model id, at] pairs, oldest first) with `added` appended (a model id once, at
    its newest time), then entries older than max_age_s (against the newest receipt) and the oldest beyond
    max_count dropped; and the model ids that dropped out."""
    latest: dict[str, float] = {}
    for receipt in added:
        latest[receipt.model_id] = max(receipt.at, latest.get(receipt.model_id, receipt.at))
    entries = [[model_id, at] for model_id, at in order if model_id not in latest]
    entries += [[model_id, at] for model_id, at in sorted(latest.items(), key=lambda item: item[1])]
    now = max(latest.values())
    kept = [entry for entry in entries if now - entry[1] < max_age_s][-max_count:]
    kept_ids = {model_id for model_id, _ in kept}
    return kept, [model_id for model_id, _ in entries if model_id not in kept_ids]
