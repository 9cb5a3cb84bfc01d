"""A full-weight sampler snapshot written behind (miles/train/write_behind.py): the host copy is the
weights at the save, whatever the trainer does after; the files are what a direct export writes; the
markers tell the gateway's side that they are whole, or why not."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from miles.train import write_behind
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.commands import StageHfWeights
from miles.train.write_behind import SnapshotWrites, WriteBehindFailed, wait_written
from miles.types import AdamParams
from tests.fast.train.test_external_export import ROWS, _datum, _hf_logprobs


def _step(backend: TransformersBackend) -> None:
    backend.forward_backward("m", [_datum(t) for t in ROWS], "cross_entropy", {})
    backend.optim_step("m", AdamParams(learning_rate=5e-2))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("tied", [False, True])
def test_the_staged_copy_is_the_saves_weights_and_writes_what_a_direct_export_does(
    tiny_model_dir: Path, tmp_path: Path, tied: bool
) -> None:
    model_dir = tiny_model_dir
    if tied:
        model_dir = tmp_path / "tied"
        shutil.copytree(tiny_model_dir, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    backend = TransformersBackend(str(model_dir), train_mode="full")
    _step(backend)
    backend.export_hf_weights(tmp_path / "direct")
    write = backend.stage_hf_weights()
    assert write is not None
    _step(backend)  # the trainer moves on before the files are written
    write(tmp_path / "behind")

    direct, behind = _tensors(tmp_path / "direct"), _tensors(tmp_path / "behind")
    assert direct.keys() == behind.keys()
    for name, tensor in direct.items():
        assert torch.equal(behind[name], tensor), name
    assert sorted(p.name for p in (tmp_path / "behind").iterdir()) == sorted(
        p.name for p in (tmp_path / "direct").iterdir()
    )
    moved = backend.forward_backward("m", [_datum(t) for t in ROWS], "cross_entropy", {}, True).logprobs
    got = _hf_logprobs(tmp_path / "behind")
    assert max(float(np.abs(g - m).max()) for g, m in zip(got, moved, strict=True)) > 1e-3


def test_the_command_stages_writes_in_a_thread_and_marks_the_directory(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = TransformersBackend(str(tiny_model_dir), train_mode="full")
    writes = SnapshotWrites()
    monkeypatch.setattr(write_behind, "WRITES", writes)
    release = threading.Event()
    inner = backend.stage_hf_weights

    def held_stage():
        write = inner()
        return lambda path: (release.wait(10), write(path))

    monkeypatch.setattr(backend, "stage_hf_weights", held_stage)
    staging = tmp_path / "staging"
    assert StageHfWeights(staging).run(backend) is True  # answered while the write waits
    assert not write_behind.written_marker(staging).exists()
    release.set()
    writes.wait()
    assert write_behind.written_marker(staging).exists() and (staging / "model.safetensors").is_file()
    assert not [p.name for p in staging.iterdir() if p.name.endswith(".written")], "beside, not in, the files"


def test_a_backend_that_cannot_stage_writes_before_answering(tmp_path: Path) -> None:
    class Plain:
        def export_hf_weights(self, path: Path) -> None:
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"w")

    staging = tmp_path / "staging"
    assert StageHfWeights(staging).run(Plain()) is False  # type: ignore[arg-type]
    assert (staging / "model.safetensors").read_bytes() == b"w"
    assert not write_behind.written_marker(staging).exists()


def test_writes_run_one_at_a_time(tmp_path: Path) -> None:
    writes, done, seen_by_second = SnapshotWrites(), [], []

    def first(path: Path) -> None:
        threading.Event().wait(0.2)
        done.append("first")

    writes.start(tmp_path / "a", first)
    writes.start(tmp_path / "b", lambda path: seen_by_second.extend(done))  # waits for the first
    writes.wait()
    assert seen_by_second == ["first"]


async def test_the_gateway_side_sees_written_failed_a_dead_trainer_and_a_timeout(tmp_path: Path) -> None:
    writes = SnapshotWrites()
    writes.start(tmp_path / "ok", lambda path: path.mkdir())
    assert await wait_written(tmp_path / "ok", lambda: None, 10) >= 0
    assert not write_behind.written_marker(tmp_path / "ok").exists(), "the marker is taken"

    def broken(path: Path) -> None:
        raise OSError(28, "No space left on device")

    writes.start(tmp_path / "full", broken)
    with pytest.raises(WriteBehindFailed, match="No space left on device"):
        await wait_written(tmp_path / "full", lambda: None, 10)
    with pytest.raises(WriteBehindFailed, match=r"trainer went away.*rank 0 exited"):
        await wait_written(tmp_path / "never", lambda: "rank 0 exited", 10)
    with pytest.raises(WriteBehindFailed, match=r"within 0\.1 s"):
        await asyncio.wait_for(wait_written(tmp_path / "never", lambda: None, 0.1), 5)
