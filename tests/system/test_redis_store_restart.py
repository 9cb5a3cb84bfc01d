"""A gateway restarted on Redis still knows its sessions, models, finished futures and checkpoints.

Writes everything through one RedisStateStore, closes it, opens a new one (and a new CheckpointManager) on
the same URL and key prefix, and reads it all back. Real redis-server: MILES_TEST_REDIS_URL, else a private
server on a free port, else skipped.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from miles.checkpoints import CheckpointManager, CheckpointNotFound
from miles.state import open_state_store
from miles.state.claims import DedupClaims, claim_ttl_s
from miles.state.futures import FutureRepository, FutureState
from miles.state.records import (
    ModelRecord,
    ModelRepository,
    SamplerRecord,
    SamplerRepository,
    SessionRecord,
    SessionRepository,
)

pytestmark = pytest.mark.system

MODEL = "sess-r:train:0"


async def _write_everything(url: str, prefix: str, root: Path) -> tuple[str, str]:
    store = open_state_store(url, key_prefix=prefix)
    try:
        await SessionRepository(store).create(
            SessionRecord(session_id="sess-r", tenant="alice", created_at=1.0, last_heartbeat=2.0, tags=["t"])
        )
        await ModelRepository(store).create(
            ModelRecord(
                model_id=MODEL,
                tenant="alice",
                session_id="sess-r",
                base_model="tiny",
                is_lora=True,
                lora_rank=4,
                created_at=1.0,
                last_request_time=1.0,
            )
        )
        await SamplerRepository(store).create(
            SamplerRecord(
                sampling_session_id="sess-r:sample:0", tenant="alice", base_model="tiny", created_at=1.0
            )
        )
        futures = FutureRepository(store)
        await futures.open("req-fb", "alice", "ForwardBackward", model_id=MODEL)
        await futures.complete("req-fb", b"\x08\x01protobuf-bytes")
        await futures.open("req-opt", "alice", "OptimStep", model_id=MODEL)
        await futures.fail("req-opt", "bad adam params", "user")
        assert (
            await DedupClaims(store).claim(DedupClaims.seq_key(MODEL, 1), "req-fb", claim_ttl_s(30, 30))
            is None
        )
        manager = CheckpointManager(root, store)
        handle = await manager.allocate("alice", MODEL, "weights", "ck1", ttl_seconds=3600)
        (handle.path / "model.safetensors").write_bytes(b"w")
        weights = await manager.commit(handle, {"has_optimizer": True, "base_model": "tiny"})
        handle = await manager.allocate("alice", MODEL, "sampler_weights", None)
        (handle.path / "adapter.safetensors").write_bytes(b"s")
        sampler = await manager.commit(handle, {"is_lora": True, "lora_rank": 4})
        return weights.tinker_path, sampler.tinker_path
    finally:
        await store.close()


async def test_everything_survives_a_store_restart(redis_url: str, tmp_path: Path) -> None:
    prefix = f"restart-{uuid.uuid4().hex[:10]}"
    root = tmp_path / "ckpt"
    weights_path, sampler_path = await _write_everything(redis_url, prefix, root)

    store = open_state_store(redis_url, key_prefix=prefix)
    try:
        session = await SessionRepository(store).get("sess-r")
        assert session is not None and session.tags == ["t"] and session.last_heartbeat == 2.0
        model = await ModelRepository(store).get(MODEL)
        assert model.lora_rank == 4
        assert model.last_checkpoint.tinker_path == weights_path
        assert model.last_sampler_checkpoint.tinker_path == sampler_path
        assert (await SamplerRepository(store).get_owned("alice", "sess-r:sample:0")).base_model == "tiny"
        futures = FutureRepository(store)
        done = await futures.get("req-fb")
        assert done.state is FutureState.COMPLETE and done.result_bytes() == b"\x08\x01protobuf-bytes"
        failed = await futures.get("req-opt")
        assert failed.state is FutureState.FAILED and failed.error.category == "user"
        assert await DedupClaims(store).claim(DedupClaims.seq_key(MODEL, 1), "req-again", 120) == "req-fb"

        manager = CheckpointManager(root, store)
        listed = await manager.list("alice", MODEL)
        assert [c.tinker_path for c in listed] == [weights_path, sampler_path]
        assert listed[0].has_optimizer and listed[0].expires_at is not None
        assert (await manager.resolve("alice", weights_path) / "model.safetensors").read_bytes() == b"w"
        with pytest.raises(CheckpointNotFound):
            await manager.resolve("bob", sampler_path)
        await manager.delete("alice", MODEL, "weights/ck1")
        assert [c.tinker_path for c in await manager.list("alice")] == [sampler_path]
    finally:
        await store.purge()
        await store.close()
