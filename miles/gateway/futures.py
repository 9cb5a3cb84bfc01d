"""Futures of Tinker operations: persisted through the StateStore, resolved by event.

A future goes PENDING -> RUNNING -> COMPLETE | FAILED (PENDING may fail or complete directly); a terminal
future never changes again. Waiters in this process are woken by an asyncio.Event the moment the
result is written, so `retrieve_future` answers within milliseconds of completion. A non-terminal future
owned by an earlier gateway process can never complete (its work died with that process), so it is
failed on sight with an error that tells the client to resubmit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from miles.gateway.errors import Category, not_found
from miles.state import StateStore

NAMESPACE = "gw.futures"


class FutureStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETE = "complete"
    FAILED = "failed"


ALLOWED_TRANSITIONS: dict[FutureStatus, frozenset[FutureStatus]] = {
    FutureStatus.PENDING: frozenset({FutureStatus.RUNNING, FutureStatus.COMPLETE, FutureStatus.FAILED}),
    FutureStatus.RUNNING: frozenset({FutureStatus.COMPLETE, FutureStatus.FAILED}),
    FutureStatus.COMPLETE: frozenset(),
    FutureStatus.FAILED: frozenset(),
}
TERMINAL = frozenset({FutureStatus.COMPLETE, FutureStatus.FAILED})


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class FutureView:
    """A future as read from the store."""

    request_id: str
    tenant: str
    kind: str
    status: FutureStatus
    owner: str
    model_id: str | None = None
    result_json: str | None = None  # JSON text (may hold NaN, which the store itself refuses)
    result_proto: bytes | None = None
    error: str | None = None
    category: Category | None = None
    updated_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_record(cls, request_id: str, rec: dict[str, Any]) -> FutureView:
        proto = rec.get("result_proto_b64")
        return cls(
            request_id=request_id,
            tenant=rec["tenant"],
            kind=rec["kind"],
            status=FutureStatus(rec["status"]),
            owner=rec.get("owner", ""),
            model_id=rec.get("model_id"),
            result_json=rec.get("result_json"),
            result_proto=None if proto is None else base64.b64decode(proto),
            error=rec.get("error"),
            category=rec.get("category"),
            updated_at=rec.get("updated_at"),
        )


def _transition(target: FutureStatus, fields: dict[str, Any]):
    def apply(current: dict[str, Any] | None) -> dict[str, Any]:
        if current is None:
            raise IllegalTransition(f"future vanished before it could become {target}")
        status = FutureStatus(current["status"])
        if target not in ALLOWED_TRANSITIONS[status]:
            raise IllegalTransition(f"future is {status}; cannot become {target}")
        return {**current, **fields, "status": target.value, "updated_at": time.time()}

    return apply


class FutureRegistry:
    def __init__(self, store: StateStore, *, ttl_s: float, instance_id: str | None = None) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self.instance_id = instance_id or uuid.uuid4().hex
        self._events: dict[str, asyncio.Event] = {}

    async def create(self, tenant: str, kind: str, *, model_id: str | None = None) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        self._events[request_id] = asyncio.Event()
        record = {
            "tenant": tenant,
            "kind": kind,
            "model_id": model_id,
            "status": FutureStatus.PENDING.value,
            "owner": self.instance_id,
            "created_at": time.time(),
        }
        await self._store.put(NAMESPACE, request_id, record, ttl_s=self._ttl_s)
        return request_id

    async def discard(self, request_id: str) -> None:
        """Forget a future nobody was told about (lost a dedup race)."""
        self._events.pop(request_id, None)
        await self._store.delete(NAMESPACE, request_id)

    async def mark_running(self, request_id: str) -> None:
        await self._store.update(NAMESPACE, request_id, _transition(FutureStatus.RUNNING, {}))

    async def complete_json(self, request_id: str, payload: dict[str, Any]) -> None:
        await self._finish(request_id, FutureStatus.COMPLETE, {"result_json": json.dumps(payload)})

    async def complete_proto(self, request_id: str, payload: bytes) -> None:
        encoded = base64.b64encode(payload).decode("ascii")
        await self._finish(request_id, FutureStatus.COMPLETE, {"result_proto_b64": encoded})

    async def fail(self, request_id: str, message: str, category: Category) -> None:
        await self._finish(request_id, FutureStatus.FAILED, {"error": message, "category": category})

    async def _finish(self, request_id: str, status: FutureStatus, fields: dict[str, Any]) -> None:
        try:
            await self._store.update(NAMESPACE, request_id, _transition(status, fields))
        finally:
            event = self._events.pop(request_id, None)
            if event is not None:
                event.set()

    async def get(self, tenant: str, request_id: str) -> FutureView:
        """The future if it exists and belongs to `tenant`; 404 otherwise (never reveal others' ids)."""
        rec = await self._store.get(NAMESPACE, request_id)
        if rec is None or rec.get("tenant") != tenant:
            raise not_found(f"future {request_id!r}")
        return FutureView.from_record(request_id, rec)

    async def wait(self, tenant: str, request_id: str, timeout_s: float) -> FutureView:
        """The future once terminal, or as it is after `timeout_s` (the caller then answers try_again)."""
        event = self._events.get(request_id)
        view = await self.get(tenant, request_id)
        if view.terminal:
            return view
        if event is None:
            if view.owner != self.instance_id:
                await self._fail_orphan(request_id)
            return await self.get(tenant, request_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return await self.get(tenant, request_id)

    async def _fail_orphan(self, request_id: str) -> None:
        message = "the gateway restarted before this operation finished; submit it again"
        with contextlib.suppress(IllegalTransition):
            await self._finish(request_id, FutureStatus.FAILED, {"error": message, "category": "server"})

    def pending_count(self) -> int:
        return len(self._events)
