"""Delete removes only a checkpoint its metadata names, owned by the caller; every refusal is a 404 that
leaves the directory tree (and the index) byte-identical."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from miles.checkpoints import CheckpointManager, CheckpointNotFound
from miles.state import MemoryStateStore

MODEL = "sess-a:train:0"
OTHER_MODEL = "sess-b:train:0"


@pytest.fixture
async def populated(manager: CheckpointManager, save, tmp_path: Path) -> CheckpointManager:
    """alice: weights/ck1, weights/ck2, sampler_weights/s1; bob: OTHER_MODEL weights/ck1; plus decoys."""
    await save(manager, "alice", MODEL, "weights", "ck1", b"alice-ck1")
    await save(manager, "alice", MODEL, "weights", "ck2", b"alice-ck2")
    await save(manager, "alice", MODEL, "sampler_weights", "s1", b"alice-s1")
    await save(manager, "bob", OTHER_MODEL, "weights", "ck1", b"bob-ck1")
    weights = manager.root / MODEL / "weights"
    os.symlink(weights / "ck1", weights / "alias")  # an alias of a real checkpoint
    os.symlink(manager.root / MODEL, manager.root / "alias-model")  # an alias of a model directory
    (weights / "plain").mkdir()  # a directory without metadata
    (weights / "plain" / "data.bin").write_bytes(b"not a checkpoint")
    (weights / "copy").mkdir()  # metadata naming a different checkpoint (ck1)
    shutil.copy(weights / "ck1" / "metadata.json", weights / "copy" / "metadata.json")
    (weights / "metalink").mkdir()  # metadata.json is a symlink
    os.symlink(weights / "ck2" / "metadata.json", weights / "metalink" / "metadata.json")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    return manager


REFUSALS = [
    pytest.param("bob", MODEL, "weights/ck1", id="other-tenant"),
    pytest.param("alice", OTHER_MODEL, "weights/ck1", id="other-tenants-model"),
    pytest.param("alice", MODEL, "weights", id="plain-weights-dir"),
    pytest.param("alice", MODEL, "sampler_weights", id="plain-sampler-dir"),
    pytest.param("alice", MODEL, ".", id="dot"),
    pytest.param("alice", MODEL, "", id="empty"),
    pytest.param("alice", MODEL, "..", id="dotdot"),
    pytest.param("alice", MODEL, "weights/..", id="weights-dotdot"),
    pytest.param("alice", MODEL, "weights/.", id="weights-dot"),
    pytest.param("alice", MODEL, "weights/../x", id="traversal"),
    pytest.param("alice", MODEL, "weights/../../outside", id="traversal-out"),
    pytest.param("alice", MODEL, "%2e%2e", id="encoded-dotdot"),
    pytest.param("alice", MODEL, "weights/%2e%2e", id="weights-encoded-dotdot"),
    pytest.param("alice", MODEL, "weights%2fck1", id="encoded-slash"),
    pytest.param("alice", MODEL, "/etc/passwd", id="absolute"),
    pytest.param("alice", MODEL, "weights//ck1", id="double-slash"),
    pytest.param("alice", MODEL, "weights/ck1/", id="trailing-slash"),
    pytest.param("alice", "/abs", "weights/ck1", id="absolute-model"),
    pytest.param("alice", "..", "weights/ck1", id="dotdot-model"),
    pytest.param("alice", ".", "weights/ck1", id="dot-model"),
    pytest.param("alice", ".staging", "weights/ck1", id="staging-model"),
    pytest.param("alice", "alias-model", "weights/ck1", id="symlinked-model-dir"),
    pytest.param("alice", MODEL, "weights/alias", id="symlink-alias"),
    pytest.param("alice", MODEL, "weights/plain", id="no-metadata"),
    pytest.param("alice", MODEL, "weights/copy", id="metadata-names-another"),
    pytest.param("alice", MODEL, "weights/metalink", id="metadata-is-symlink"),
    pytest.param("alice", MODEL, "sampler_weights/ck1", id="wrong-kind"),
    pytest.param("alice", MODEL, "external_weights/ck1", id="unknown-kind"),
    pytest.param("alice", MODEL, "weights/missing", id="missing"),
]


@pytest.mark.parametrize(("tenant", "model_id", "checkpoint_id"), REFUSALS)
async def test_refusal_is_404_and_touches_nothing(
    populated: CheckpointManager,
    store: MemoryStateStore,
    fingerprint,
    tmp_path: Path,
    tenant: str,
    model_id: str,
    checkpoint_id: str,
) -> None:
    tree_before = fingerprint(tmp_path)
    index_before = await store.list("checkpoints")
    with pytest.raises(CheckpointNotFound):
        await populated.delete(tenant, model_id, checkpoint_id)
    assert fingerprint(tmp_path) == tree_before
    assert await store.list("checkpoints") == index_before


async def test_delete_removes_exactly_one_directory(
    populated: CheckpointManager, store: MemoryStateStore, fingerprint, tmp_path: Path
) -> None:
    before = fingerprint(tmp_path)
    removed = await populated.delete("alice", MODEL, "weights/ck1")
    assert removed.tinker_path == f"tinker://{MODEL}/weights/ck1"
    after = fingerprint(tmp_path)
    gone = set(before) - set(after)
    ck1 = f"ckpt/{MODEL}/weights/ck1"
    assert gone == {ck1, f"{ck1}/model.safetensors", f"{ck1}/metadata.json"}
    assert set(after) - set(before) == set()
    assert all(after[k] == before[k] for k in after)
    # the alias now dangles, the copy and bob's ck1 are untouched; the index lost exactly one entry
    assert [k for k, _ in await store.list("checkpoints")] == [
        f"{MODEL}/sampler_weights/s1",
        f"{MODEL}/weights/ck2",
        f"{OTHER_MODEL}/weights/ck1",
    ]
    with pytest.raises(CheckpointNotFound):
        await populated.resolve("alice", f"tinker://{MODEL}/weights/ck1")
    with pytest.raises(CheckpointNotFound):
        await populated.delete("alice", MODEL, "weights/ck1")


async def test_delete_of_sampler_snapshot(populated: CheckpointManager) -> None:
    await populated.delete("alice", MODEL, "sampler_weights/s1")
    assert [c.checkpoint_id for c in await populated.list("alice")] == ["weights/ck1", "weights/ck2"]
