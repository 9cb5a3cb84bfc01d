"""A kept group's push without Describe, through the real driver and sender (bench/push_nccl.py's harness:
a trainer process and an in-process CPU engine over gloo): the steady-state push plans from the last
push's tensors, and a trainer that no longer holds the group answers StaleLayout, after which the push
describes it and makes a fresh group; every push leaves the engine with the trainer's exact weights."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import push_nccl

from miles.weights.push import PushConfig, drop_kept_group, push_full_weights
from miles.weights.sender import Close


async def _push_and_compare(controller, trainer, client, config) -> tuple[object, int]:
    """(the push's report, how many tensors differ between trainer and engine afterwards)."""
    report = await push_full_weights(controller, trainer, config)
    sums = await asyncio.to_thread(trainer.request, "checksums")
    mine = push_nccl.engine_checksums(client.engine, list(sums))
    return report, sum(1 for name, value in sums.items() if mine[name] != value)


async def _scenario(model_dir: Path) -> None:
    engine = push_nccl.Engine(str(model_dir))
    await engine.load()
    await engine.wait_loaded()
    trainer = push_nccl.TrainerProcess(model_dir, "float32", None)
    try:
        client = push_nccl.DirectEngineClient(engine)
        controller = push_nccl.InferenceController([push_nccl.DirectEngineCell(client)])
        config = PushConfig(bucket_bytes=64 * 1024, backend="gloo")
        tokens = np.arange(1, 34, dtype=np.int64)
        first, differ = await _push_and_compare(controller, trainer, client, config)
        assert not first.reused_group and "describe" in first.steps and differ == 0
        await asyncio.to_thread(trainer.request, "step", tokens)  # new values, same memory
        steady, differ = await _push_and_compare(controller, trainer, client, config)
        assert steady.reused_group and steady.group == first.group
        assert "describe" not in steady.steps, "the kept group's push plans from the last push's tensors"
        assert differ == 0, "the step's new weights reached the engine"
        # the trainer leaves the group behind the driver's back (as a restarted trainer holds none)
        assert await trainer.run(Close(first.group, abort=True))
        await asyncio.to_thread(trainer.request, "step", tokens)
        fallback, differ = await _push_and_compare(controller, trainer, client, config)
        assert not fallback.reused_group and fallback.group != first.group and "describe" in fallback.steps
        assert differ == 0
        await drop_kept_group(controller, trainer)
    finally:
        trainer.stop()
        await engine.close()


@pytest.mark.timeout(180)
def test_a_kept_groups_push_skips_describe_and_falls_back_when_the_trainer_lost_the_group(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    push_nccl.write_model(tmp_path, "tiny", torch.float32, "cpu")
    asyncio.run(_scenario(tmp_path))
