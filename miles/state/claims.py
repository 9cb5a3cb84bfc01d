"""Dedup claims: first submit wins, and a retried submit learns the original request_id."""

from __future__ import annotations

from miles.state.store import JsonDict, StateStore, StateStoreError

# A dedup claim must outlive the work it guards: queued, executed, then answered.
CLAIM_TTL_MARGIN_S = 60.0


def claim_ttl_s(queue_timeout_s: float, execution_timeout_s: float) -> float:
    """How long a dedup claim must live: the guarded work may queue, then run, then be answered."""
    if queue_timeout_s < 0 or execution_timeout_s < 0:
        raise ValueError("queue_timeout_s and execution_timeout_s must be >= 0")
    return queue_timeout_s + execution_timeout_s + CLAIM_TTL_MARGIN_S


class DedupClaims:
    """First-submit-wins claims: a retried submit learns the original request_id."""

    namespace = "dedup"

    def __init__(self, store: StateStore, *, min_ttl_s: float = CLAIM_TTL_MARGIN_S) -> None:
        self.store = store
        self.min_ttl_s = min_ttl_s

    @staticmethod
    def seq_key(model_id: str, seq_id: int) -> str:
        return f"seq:{model_id}:{seq_id}"

    @staticmethod
    def sample_key(sampling_session_id: str, seq_id: int) -> str:
        return f"sample:{sampling_session_id}:{seq_id}"

    @staticmethod
    def idempotency_key(tenant: str, key: str) -> str:
        return f"idem:{tenant}:{key}"

    async def claim(self, key: str, request_id: str, ttl_s: float) -> str | None:
        """Claim `key` for `request_id`: None if we won, else the request_id that holds it."""
        if ttl_s < self.min_ttl_s:
            raise ValueError(
                f"dedup claim ttl {ttl_s} s is below the minimum {self.min_ttl_s} s (see claim_ttl_s)"
            )
        # The holder may expire between our failed claim and our read; then claim again.
        for _ in range(3):
            if await self.store.put_if_absent(self.namespace, key, {"request_id": request_id}, ttl_s=ttl_s):
                return None
            holder = await self.store.get(self.namespace, key)
            if holder is not None:
                return str(holder["request_id"])
        raise StateStoreError(f"dedup claim {key} kept expiring while being read")

    async def holder(self, key: str) -> str | None:
        held = await self.store.get(self.namespace, key)
        return None if held is None else str(held["request_id"])

    async def release(self, key: str, request_id: str) -> bool:
        """Drop the claim only if `request_id` still holds it (e.g. its submit failed before queueing)."""
        released = False

        def drop_if_mine(held: JsonDict | None) -> JsonDict | None:
            nonlocal released
            released = held is not None and held.get("request_id") == request_id
            return None if released else held

        await self.store.update(self.namespace, key, drop_if_mine)
        return released
