"""A CheckpointManager over a temp root and a memory store, plus a tree fingerprint for refusal tests."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from miles.checkpoints import CheckpointInfo, CheckpointManager
from miles.state import MemoryStateStore


class StepClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def store() -> MemoryStateStore:
    return MemoryStateStore()


@pytest.fixture
def manager(tmp_path: Path, store: MemoryStateStore, clock: StepClock) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", store, clock=clock)


async def _save(
    manager: CheckpointManager,
    tenant: str,
    model_id: str,
    kind: str,
    name: str | None,
    payload: bytes = b"weights",
    **allocate_kw,
) -> CheckpointInfo:
    """A save as the gateway does it: allocate, the trainer writes files, commit."""
    handle = await manager.allocate(tenant, model_id, kind, name, **allocate_kw)
    (handle.path / "model.safetensors").write_bytes(payload)
    return await manager.commit(handle, {"has_optimizer": False, "base_model": "tiny", "is_lora": True})


def _tree_fingerprint(root: Path) -> dict[str, str]:
    """Every entry under root (not following links): dirs, link targets, file content hashes."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def save() -> Callable[..., Awaitable[CheckpointInfo]]:
    return _save


@pytest.fixture
def fingerprint() -> Callable[[Path], dict[str, str]]:
    return _tree_fingerprint
