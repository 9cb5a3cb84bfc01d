"""Saving, finding, listing and expiring checkpoints."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.checkpoints import (
    CheckpointExists,
    CheckpointManager,
    CheckpointNotFound,
    InvalidCheckpointName,
)
from miles.state import MemoryStateStore
from miles.state.records import ModelRecord, ModelRepository

MODEL = "sess-a:train:0"


async def test_commit_writes_metadata_indexes_and_resolves(
    manager: CheckpointManager, save, fingerprint
) -> None:
    info = await save(manager, "alice", MODEL, "weights", "ckpt-001", b"abc")
    assert info.tinker_path == f"tinker://{MODEL}/weights/ckpt-001"
    path = await manager.resolve("alice", info.tinker_path)
    assert path == manager.root / MODEL / "weights" / "ckpt-001"
    assert (path / "model.safetensors").read_bytes() == b"abc"
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["tinker_path"] == info.tinker_path and meta["tenant"] == "alice"
    assert meta["size_bytes"] == 3 and meta["base_model"] == "tiny" and meta["is_lora"] is True
    assert [c.tinker_path for c in await manager.list("alice")] == [info.tinker_path]
    wire = info.to_tinker()
    assert wire["checkpoint_id"] == "weights/ckpt-001" and wire["checkpoint_type"] == "training"
    assert list((manager.root / ".staging").iterdir()) == []


async def test_other_tenants_see_nothing(manager: CheckpointManager, save, fingerprint) -> None:
    info = await save(manager, "alice", MODEL, "sampler_weights", "s1")
    with pytest.raises(CheckpointNotFound):
        await manager.resolve("bob", info.tinker_path)
    with pytest.raises(CheckpointNotFound):
        await manager.info("bob", info.tinker_path)
    assert await manager.list("bob") == []
    assert await manager.list("bob", MODEL) == []


async def test_unnamed_saves_get_unique_names(manager: CheckpointManager, save, fingerprint) -> None:
    infos = [await save(manager, "alice", MODEL, "sampler_weights", None) for _ in range(3)]
    assert len({i.name for i in infos}) == 3
    assert [c.name for c in await manager.list("alice", MODEL)] == [i.name for i in infos]


async def test_refuses_overwrite_unless_asked(manager: CheckpointManager, save, fingerprint) -> None:
    await save(manager, "alice", MODEL, "weights", "c", b"one")
    with pytest.raises(CheckpointExists, match="overwrite"):
        await save(manager, "alice", MODEL, "weights", "c", b"two")
    await save(manager, "alice", MODEL, "weights", "c", b"three", overwrite=True)
    path = await manager.resolve("alice", f"tinker://{MODEL}/weights/c")
    assert (path / "model.safetensors").read_bytes() == b"three"
    assert len(await manager.list("alice")) == 1
    assert list((manager.root / ".trash").iterdir()) == []


async def test_sampler_snapshots_are_immutable(manager: CheckpointManager, save, fingerprint) -> None:
    await save(manager, "alice", MODEL, "sampler_weights", "snap", b"v1")
    before = fingerprint(manager.root)
    with pytest.raises(CheckpointExists, match="immutable"):
        await save(manager, "alice", MODEL, "sampler_weights", "snap", b"v2", overwrite=True)
    assert fingerprint(manager.root) == before


async def test_another_tenant_cannot_overwrite(manager: CheckpointManager, save, fingerprint) -> None:
    await save(manager, "alice", MODEL, "weights", "c", b"alice")
    before = fingerprint(manager.root)
    with pytest.raises(CheckpointExists):
        await save(manager, "bob", MODEL, "weights", "c", b"bob", overwrite=True)
    assert fingerprint(manager.root) == before


async def test_concurrent_saves_of_one_name_one_wins(manager: CheckpointManager, save, fingerprint) -> None:
    results = await asyncio.gather(
        *(manager.allocate("alice", MODEL, "weights", "same") for _ in range(5)), return_exceptions=True
    )
    handles = [r for r in results if not isinstance(r, BaseException)]
    assert len(handles) == 1
    assert all(isinstance(r, CheckpointExists) for r in results if isinstance(r, BaseException))
    await manager.abort(handles[0])
    assert not handles[0].path.exists()
    await save(manager, "alice", MODEL, "weights", "same")  # the name is free again


async def test_bad_names_and_metadata_are_user_errors(manager: CheckpointManager, save, fingerprint) -> None:
    with pytest.raises(InvalidCheckpointName):
        await manager.allocate("alice", MODEL, "weights", "../escape")
    with pytest.raises(InvalidCheckpointName):
        await manager.allocate("alice", "../x", "weights", "n")
    handle = await manager.allocate("alice", MODEL, "weights", "n")
    with pytest.raises(ValueError, match="unknown checkpoint metadata"):
        await manager.commit(handle, {"tenant": "bob"})
    assert not handle.path.exists()
    assert await manager.list("alice") == []
    await save(manager, "alice", MODEL, "weights", "n")  # the failed commit released the name


async def test_commit_updates_the_model_record(
    manager: CheckpointManager, store: MemoryStateStore, save, fingerprint
) -> None:
    models = ModelRepository(store)
    await models.create(
        ModelRecord(
            model_id=MODEL,
            tenant="alice",
            session_id="sess-a",
            base_model="tiny",
            is_lora=True,
            created_at=1.0,
            last_request_time=1.0,
        )
    )
    w = await save(manager, "alice", MODEL, "weights", "w1")
    s = await save(manager, "alice", MODEL, "sampler_weights", "s1")
    rec = await models.get(MODEL)
    assert rec.last_checkpoint == w and rec.last_sampler_checkpoint == s
    await manager.delete("alice", MODEL, "weights/w1")
    rec = await models.get(MODEL)
    assert rec.last_checkpoint is None and rec.last_sampler_checkpoint == s


async def test_index_rebuilt_from_disk_for_a_fresh_store(
    manager: CheckpointManager, clock, save, fingerprint
) -> None:
    info = await save(manager, "alice", MODEL, "weights", "kept")
    fresh = CheckpointManager(manager.root, MemoryStateStore(), clock=clock)
    with pytest.raises(CheckpointNotFound):
        await fresh.resolve("bob", info.tinker_path)
    assert await fresh.resolve("alice", info.tinker_path) == manager.root / MODEL / "weights" / "kept"
    assert [c.tinker_path for c in await fresh.list("alice")] == [info.tinker_path]


async def test_ttl_is_recorded_and_swept(manager: CheckpointManager, clock, save, fingerprint) -> None:
    short = await save(manager, "alice", MODEL, "weights", "short", ttl_seconds=100)
    keep = await save(manager, "alice", MODEL, "weights", "keep")
    assert short.ttl_seconds == 100 and short.expires_at == short.created_at + 100
    assert short.to_tinker()["expires_at"] is not None and keep.expires_at is None
    assert await manager.sweep_expired() == []
    clock.now += 200
    assert await manager.sweep_expired() == [short.tinker_path]
    assert [c.name for c in await manager.list("alice")] == ["keep"]
    assert not (manager.root / MODEL / "weights" / "short").exists()
    updated = await manager.set_ttl("alice", MODEL, "weights/keep", 50)
    assert updated.expires_at == pytest.approx(clock.now + 50, abs=2)
    with pytest.raises(CheckpointNotFound):
        await manager.set_ttl("bob", MODEL, "weights/keep", 50)  # another tenant's checkpoint
    assert (await manager.set_ttl("alice", MODEL, "weights/keep", None)).expires_at is None
    clock.now += 1000
    assert await manager.sweep_expired() == [], "a TTL removed is never swept"
    await manager.set_ttl("alice", MODEL, "weights/keep", 10)
    clock.now += 20
    with manager.pinned(keep.tinker_path):  # a load or a sample reads it now
        assert await manager.sweep_expired() == []
    assert await manager.sweep_expired(in_use={keep.tinker_path}) == []  # an open sampler serves it
    assert await manager.sweep_expired() == [keep.tinker_path]


async def test_reindex_from_disk_skips_invalid_and_aliased_dirs(
    manager: CheckpointManager, save, clock
) -> None:
    a = await save(manager, "alice", MODEL, "weights", "a")
    b = await save(manager, "bob", "sess-b:train:3", "sampler_weights", "b")
    weights = manager.root / MODEL / "weights"
    (weights / "plain").mkdir()
    (weights / "alias").symlink_to(weights / "a")
    (manager.root / "alias-model").symlink_to(manager.root / MODEL)
    fresh = CheckpointManager(manager.root, MemoryStateStore(), clock=clock)
    assert await fresh.reindex_from_disk() == 2
    assert await fresh.reindex_from_disk() == 0
    assert [c.tinker_path for c in await fresh.list("alice")] == [a.tinker_path]
    assert [c.tinker_path for c in await fresh.list("bob")] == [b.tinker_path]
