"""Training models and samplers known to the gateway, each owned by one tenant (404 for everyone else)."""

from __future__ import annotations

import time
from typing import Any

from miles.gateway.errors import not_found
from miles.state import StateStore
from miles.state.records import ModelRecord, ModelRepository

SAMPLERS = "gw.samplers"


class ModelRegistry:
    """Models through the state package's ModelRepository (the CheckpointManager updates the same records)."""

    def __init__(self, store: StateStore) -> None:
        self._repo = ModelRepository(store)

    async def put(
        self,
        tenant: str,
        model_id: str,
        *,
        session_id: str,
        base_model: str,
        lora_rank: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> ModelRecord:
        now = time.time()
        record = ModelRecord(
            model_id=model_id,
            tenant=tenant,
            session_id=session_id,
            base_model=base_model,
            is_lora=lora_rank is not None,
            lora_rank=lora_rank,
            train_mode="lora" if lora_rank is not None else "full",
            created_at=now,
            last_request_time=now,
            user_metadata=user_metadata or {},
        )
        await self._repo.save(record)
        return record

    async def require(self, tenant: str, model_id: str) -> ModelRecord:
        record = await self._repo.get_owned(tenant, model_id)
        if record is None:
            raise not_found(f"model {model_id!r}")
        return record

    async def exists_for(self, tenant: str, model_id: str) -> bool:
        return await self._repo.get_owned(tenant, model_id) is not None

    async def touch(self, model_id: str) -> None:
        await self._repo.touch(model_id)

    async def list(self, tenant: str) -> list[ModelRecord]:
        return sorted(await self._repo.list(tenant=tenant), key=lambda r: r.created_at)

    async def delete(self, model_id: str) -> None:
        await self._repo.delete(model_id)


class SamplerRegistry:
    def __init__(self, store: StateStore) -> None:
        self._store = store

    async def put(self, tenant: str, sampler_id: str, *, base_model: str, model_path: str | None) -> None:
        record = {
            "tenant": tenant,
            "base_model": base_model,
            "model_path": model_path,
            "created_at": time.time(),
        }
        await self._store.put(SAMPLERS, sampler_id, record)

    async def require(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        rec = await self._store.get(SAMPLERS, sampler_id)
        if rec is None or rec.get("tenant") != tenant:
            raise not_found(f"sampler {sampler_id!r}")
        return rec
