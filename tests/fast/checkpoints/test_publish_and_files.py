"""Publishing (who may read a checkpoint) and the downloadable files of an export."""

from __future__ import annotations

import os

import pytest

from miles.checkpoints import CheckpointManager, CheckpointNotFound

MODEL = "sess-a:train:0"


async def test_a_published_checkpoint_is_readable_by_others_and_only_the_owner_changes_it(
    manager: CheckpointManager, save
) -> None:
    info = await save(manager, "alice", MODEL, "weights", "w1")
    with pytest.raises(CheckpointNotFound):
        await manager.locate_readable("bob", info.tinker_path)
    assert not await manager.has_public(MODEL)
    with pytest.raises(CheckpointNotFound):  # publishing is the owner's
        await manager.set_public("bob", MODEL, "weights/w1", True)

    assert (await manager.set_public("alice", MODEL, "weights/w1", True)).public
    assert (await manager.set_public("alice", MODEL, "weights/w1", True)).public  # no-op, no error
    path, record = await manager.locate_readable("bob", info.tinker_path)
    assert path == manager.root / MODEL / "weights" / "w1" and record.tenant == "alice"
    assert await manager.has_public(MODEL) and not await manager.has_public("sess-b:train:0")
    assert [c.public for c in await manager.list("alice")] == [True]
    with pytest.raises(CheckpointNotFound):  # reading is shared, owning is not
        await manager.locate("bob", info.tinker_path)
    with pytest.raises(CheckpointNotFound):
        await manager.delete("bob", MODEL, "weights/w1")

    await manager.set_public("alice", MODEL, "weights/w1", False)
    with pytest.raises(CheckpointNotFound):
        await manager.locate_readable("bob", info.tinker_path)


async def test_an_export_lists_its_regular_files_only(manager: CheckpointManager, save, tmp_path) -> None:
    info = await save(manager, "alice", MODEL, "external_weights", "hf")
    directory, record = await manager.locate("alice", info.tinker_path)
    assert record.checkpoint_type == "external" and record.to_tinker()["checkpoint_type"] == "external"
    (directory / "tok").mkdir()
    (directory / "tok" / "tokenizer.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    os.symlink(secret, directory / "leak.txt")  # a link to outside the checkpoint is never served
    os.symlink(tmp_path, directory / "outside")
    files = manager.files_of(directory)
    assert sorted(files) == ["model.safetensors", "tok/tokenizer.json"]  # no metadata.json, no links
    found, _ = await manager.locate_indexed(info.tinker_path)
    assert found == directory
    with pytest.raises(CheckpointNotFound):
        await manager.locate_indexed(f"tinker://{MODEL}/external_weights/missing")
