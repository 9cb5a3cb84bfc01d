"""Receipts of ended handles, bounded in number and age: an operation on a handle that ended gets a
clear "expired" answer naming why, instead of "not found", for as long as the receipt is kept."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Receipt:
    model_id: str
    reason: str  # "idle" | "lifetime" | "released" | "instance_lost"
    detail: str  # the sentence the caller reads
    at: float


class ReceiptLog:
    def __init__(self, *, max_count: int, max_age_s: float) -> None:
        if max_count < 1 or max_age_s <= 0:
            raise ValueError("receipts need max_count >= 1 and max_age_s > 0")
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._by_model: OrderedDict[str, Receipt] = OrderedDict()

    def record(self, receipt: Receipt) -> None:
        self._by_model.pop(receipt.model_id, None)
        self._by_model[receipt.model_id] = receipt
        self.prune(receipt.at)

    def prune(self, now: float) -> None:
        while len(self._by_model) > self.max_count:
            self._by_model.popitem(last=False)
        # Insertion order is time order (record() re-inserts), so the oldest are at the front.
        while self._by_model:
            oldest = next(iter(self._by_model.values()))
            if now - oldest.at < self.max_age_s:
                break
            self._by_model.popitem(last=False)

    def get(self, model_id: str, now: float) -> Receipt | None:
        self.prune(now)
        return self._by_model.get(model_id)

    def forget(self, model_id: str) -> None:
        self._by_model.pop(model_id, None)

    def __len__(self) -> int:
        return len(self._by_model)
