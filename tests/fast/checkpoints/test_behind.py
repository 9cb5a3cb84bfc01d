"""Checkpoints committed behind their save's answer (miles/checkpoints/behind.py): sampling names the
snapshot at once; what needs its files waits for the commit; a failed write leaves no checkpoint, frees the
name and says why."""

from __future__ import annotations

import asyncio

import pytest

from miles.checkpoints import CheckpointManager, CheckpointNotFound
from miles.contract import events

MODEL = "sess-a:train:0"
META = {"has_optimizer": False, "base_model": "tiny", "is_lora": False}


@pytest.fixture
def event_log(tmp_path):
    """This process's event log (RUN_DIR/events.jsonl) in a temp run dir, for the test."""
    events.configure(tmp_path / "run")
    (tmp_path / "run").mkdir()
    yield tmp_path / "run"
    events.configure(None)


async def _behind(manager: CheckpointManager, name: str) -> tuple[object, asyncio.Future[None]]:
    """A save answered before its files: the handle and the future the write completes."""
    handle = await manager.allocate("alice", MODEL, "sampler_weights", name)
    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    provisional = manager.commit_behind(handle, META, written)
    assert provisional.tinker_path == handle.tinker_path and provisional.size_bytes == 0
    return handle, written


async def test_sampling_finds_it_at_once_and_file_lookups_wait_for_the_commit(
    manager: CheckpointManager,
) -> None:
    handle, written = await _behind(manager, "s1")
    path, info = await manager.locate_readable("alice", handle.tinker_path, files=False)
    assert path == handle.final_path and not path.exists() and info.kind == "sampler_weights"
    with pytest.raises(CheckpointNotFound):  # another tenant: as if it did not exist
        await manager.locate_readable("bob", handle.tinker_path, files=False)

    lookups = [
        asyncio.ensure_future(manager.resolve("alice", handle.tinker_path)),
        asyncio.ensure_future(manager.list("alice", MODEL)),
        asyncio.ensure_future(manager.locate_readable("alice", handle.tinker_path)),
    ]
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in lookups), "they need the files: they wait"
    (handle.path / "model.safetensors").write_bytes(b"weights")
    written.set_result(None)
    resolved, listed, (located, record) = await asyncio.gather(*lookups)
    assert resolved == located == handle.final_path and (resolved / "model.safetensors").is_file()
    assert [c.tinker_path for c in listed] == [handle.tinker_path] and record.size_bytes == 7
    assert list((manager.root / ".staging").iterdir()) == []


async def test_a_failed_write_keeps_nothing_frees_the_name_and_says_why(
    manager: CheckpointManager, event_log
) -> None:
    handle, written = await _behind(manager, "s2")
    (handle.path / "model.safetensors").write_bytes(b"half")
    waiting = asyncio.ensure_future(manager.info("alice", handle.tinker_path))
    written.set_exception(OSError(28, "No space left on device"))
    with pytest.raises(CheckpointNotFound, match=r"not kept.*No space left on device.*save it again"):
        await waiting
    with pytest.raises(CheckpointNotFound, match="No space left"):  # files=False too: nothing serves it
        await manager.locate_readable("alice", handle.tinker_path, files=False)
    with pytest.raises(CheckpointNotFound) as other:
        await manager.info("bob", handle.tinker_path)
    assert "No space" not in str(other.value), "another tenant learns nothing of it"
    assert not handle.path.exists() and not handle.final_path.exists()
    assert await manager.list("alice") == []
    again, written = await _behind(manager, "s2")  # the name is free again, and the failure forgotten
    written.set_result(None)
    assert (await manager.info("alice", again.tinker_path)).name == "s2"
    logged = [e for e in events.read_events(event_log) if e["kind"] == "checkpoint_behind"]
    assert [e["path"] for e in logged] == [handle.tinker_path] * 2, "for the operator: each outcome"
    assert "No space left" in logged[0]["error"] and "error" not in logged[1] and logged[1]["seconds"] >= 0


async def test_a_second_save_of_a_name_being_written_is_refused(manager: CheckpointManager) -> None:
    from miles.checkpoints import CheckpointExists

    handle, written = await _behind(manager, "s3")
    with pytest.raises(CheckpointExists, match="being written"):
        await manager.allocate("alice", MODEL, "sampler_weights", "s3")
    written.set_result(None)
    await manager.info("alice", handle.tinker_path)


async def test_drain_commits_what_finishes_in_time_and_aborts_the_rest(manager: CheckpointManager) -> None:
    quick, quick_written = await _behind(manager, "quick")
    slow, _never = await _behind(manager, "slow")
    asyncio.get_running_loop().call_later(0.05, quick_written.set_result, None)
    assert await manager.drain(0.5) == 1
    assert (await manager.info("alice", quick.tinker_path)).tinker_path == quick.tinker_path
    with pytest.raises(CheckpointNotFound, match="gateway stopped"):
        await manager.info("alice", slow.tinker_path)
    assert not slow.path.exists()
