"""The weight push end to end: real Ray (logical GPUs), real CPU engine processes in engine cells, real
trainer cells, the real InferenceController lock. One Ray session and one event loop for the module;
tests run in file order and share two engines.

The fault drills use `SenderHost`, a small Ray actor that runs the real sender on the real training
backend but can be told to raise before a bucket (a real trainer cell would, by design, mark itself
errored on such a failure; the drill is about the push's bracket, not the trainer's lifecycle).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import ray
import torch
from ray.util.placement_group import remove_placement_group

from miles.cluster.placement import create_gpu_placement_group
from miles.engines.config import EngineConfig
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.rollout.health import HealthCheckConfig
from miles.train.cell import TrainerCell
from miles.train.commands import CreateAdapter, ExportAdapter, ForwardBackward, OptimStep, TrainerCommand
from miles.types import AdamParams, Datum, LoraSpec
from miles.weights.push import PushConfig, drop_kept_group, publish_adapter_dir, push_full_weights
from miles.weights.sender import Broadcast, open_sessions
from tests.fast.local_ray import init_local_ray

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11]
SMALL_BUCKETS = PushConfig(bucket_bytes=64 * 1024, group_timeout_s=60, cleanup_timeout_s=20)
HEALTH = HealthCheckConfig(interval_s=0.3, timeout_s=2, failure_threshold=3)


def datum(tokens: list[int]) -> Datum:
    ids = np.asarray(tokens, dtype=np.int64)
    weights = np.ones(len(ids) - 1, dtype=np.float32)
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": weights})


TRAIN_BATCH = [datum([1, 2, 3, 4, 5, 6, 7, 8]), datum([40, 41, 42, 43, 44])]
BIG_STEP = AdamParams(learning_rate=5e-2)


@ray.remote(num_cpus=0)
class SenderHost:
    """Trainer stand-in for fault drills: the real backend and the real sender, plus a fault switch."""

    def __init__(self, model_path: str) -> None:
        from miles.train.backends.transformers_backend import TransformersBackend

        torch.set_num_threads(1)
        self.backend = TransformersBackend(model_path, train_mode="full")
        self.fail_before_bucket: int | None = None

    def train_step(self) -> None:
        self.backend.forward_backward("full", TRAIN_BATCH, "cross_entropy", {}, False)
        self.backend.optim_step("full", BIG_STEP)

    def arm(self, bucket_index: int | None) -> None:
        self.fail_before_bucket = bucket_index

    def execute(self, command: TrainerCommand[Any]) -> Any:
        if isinstance(command, Broadcast) and command.bucket_index == self.fail_before_bucket:
            self.fail_before_bucket = None
            raise RuntimeError(f"injected trainer failure before bucket {command.bucket_index + 1}")
        return command.run(self.backend)

    def open_sessions(self) -> list[str]:
        return open_sessions()


class ActorCaller:
    """TrainerClient over the SenderHost actor (one rank, no cell lifecycle)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def run(self, command: TrainerCommand[Any]) -> Any:
        return await self.actor.execute.remote(command)


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=8, num_gpus=8)
    yield
    ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(ray_session, tiny_model_dir: Path):
    pg = await create_gpu_placement_group(4, cpus_per_bundle=1, timeout_s=120)
    engine_config = EngineConfig(
        model_path=str(tiny_model_dir),
        num_cpus=1,
        startup_timeout_s=120,
        env={"SGLANG_TIMEOUT_KEEP_ALIVE": "5"},  # SGLang's own default, not our 600: the keep-alive drill
    )
    controller = InferenceController(
        [EngineCell(i, engine_config, (pg, 2 + i)) for i in range(2)], health=HEALTH
    )
    full, lora = TrainerCell(0), TrainerCell(1)
    host = SenderHost.remote(str(tiny_model_dir))
    await asyncio.gather(
        controller.start(),
        full.start([(pg, 0)], model_path=str(tiny_model_dir), train_mode="full"),
        lora.start([(pg, 1)], model_path=str(tiny_model_dir), train_mode="lora"),
        host.train_step.remote(),
    )
    yield {"controller": controller, "full": full, "lora": lora, "host": ActorCaller(host)}
    await controller.stop()
    await full.stop()
    await lora.stop()
    ray.kill(host)
    remove_placement_group(pg)


async def engine_logprobs(client: Any, lora: str | None = None) -> np.ndarray:
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
        lora_path=lora,
    )
    pairs = out["meta_info"]["input_token_logprobs"]
    assert pairs[0][0] is None  # the first prompt token has no logprob, as in SGLang
    return np.asarray([p[0] for p in pairs[1:]], dtype=np.float64)


async def trainer_logprobs(trainer: Any, key: str) -> np.ndarray:
    out = await trainer.run(ForwardBackward(key, [datum(PROMPT)], "cross_entropy", {}, forward_only=True))
    return np.asarray(out.logprobs[0], dtype=np.float64)


async def assert_engines_serve(controller: InferenceController, trainer: Any, key: str = "full") -> None:
    expected = await trainer_logprobs(trainer, key)
    ready = controller.ready_engines()
    assert len(ready) == len(controller.cells)
    for client in ready:
        np.testing.assert_allclose(await engine_logprobs(client), expected, atol=1e-4, rtol=0)


def assert_aborted_cleanly(controller: InferenceController, *, health_running: bool) -> None:
    assert not controller.update_in_progress, "the controller lock leaked"
    assert controller.ready_engines() == [], "an engine was marked ready by an aborted push"
    assert controller.health.running is health_running


async def test_full_push_makes_engine_logprobs_equal_the_trainers(stack) -> None:
    controller, full = stack["controller"], stack["full"]
    assert controller.ready_engines() == []  # not routed to before the first push
    await full.run(ForwardBackward("full", TRAIN_BATCH, "cross_entropy", {}))
    await full.run(OptimStep("full", BIG_STEP))
    stale = await engine_logprobs(controller.cells[0].client)
    assert np.abs(stale - await trainer_logprobs(full, "full")).max() > 1e-3  # the step changed weights

    report = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert report.buckets > 3 and report.engines == 2 and report.version == 1
    await assert_engines_serve(controller, full)
    for client in controller.ready_engines():
        assert (await client.model_info())["weight_version"] == "1"


async def test_unflattened_push_with_a_5s_gap_against_5s_keepalive_engines(stack) -> None:
    controller, full = stack["controller"], stack["full"]
    await full.run(ForwardBackward("full", TRAIN_BATCH, "cross_entropy", {}))
    await full.run(OptimStep("full", BIG_STEP))
    # the incident: idle exactly as long as the engines' keep-alive between two buckets
    config = PushConfig(bucket_bytes=600 * 1024, flattened=False, bucket_gap_s=5.0, group_timeout_s=60)
    report = await push_full_weights(controller, full, config)
    assert report.buckets == 2
    await assert_engines_serve(controller, full)


async def test_adapter_push_makes_engine_logprobs_equal_the_trainers(stack, tmp_path: Path) -> None:
    controller, lora = stack["controller"], stack["lora"]
    await push_full_weights(controller, lora, SMALL_BUCKETS)  # the engines' base = the LoRA trainer's base
    await lora.run(CreateAdapter("tenant-a", LoraSpec(rank=4, seed=3)))
    for round_ in range(2):  # the second push replaces the loaded adapter (unload + load)
        await lora.run(ForwardBackward("tenant-a", TRAIN_BATCH, "cross_entropy", {}))
        await lora.run(OptimStep("tenant-a", BIG_STEP))
        path = str(tmp_path / f"tenant-a-{round_}")  # what save_for_sampler + publish_sampler do
        await lora.run(ExportAdapter("tenant-a", Path(path)))
        await publish_adapter_dir(controller, lora_name="tenant-a", path=path)
        assert controller.published_adapters == {"tenant-a": path}
        expected = await trainer_logprobs(lora, "tenant-a")
        ready = controller.ready_engines()
        assert len(ready) == 2, f"round {round_}"
        for client in ready:
            got = await engine_logprobs(client, lora="tenant-a")
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
            assert np.abs(got - await engine_logprobs(client)).max() > 1e-4  # the adapter is applied


async def test_trainer_raising_before_bucket_2_aborts_and_the_next_push_succeeds(stack) -> None:
    controller, host = stack["controller"], stack["host"]
    controller.start_health_checks()
    await push_full_weights(controller, host, SMALL_BUCKETS)
    version = controller.weight_version
    await host.actor.arm.remote(1)
    with pytest.raises(Exception, match="injected trainer failure before bucket 2"):
        await push_full_weights(controller, host, SMALL_BUCKETS)
    assert_aborted_cleanly(controller, health_running=True)
    assert controller.weight_version == version
    assert await host.actor.open_sessions.remote() == []  # the trainer left the group
    report = await push_full_weights(controller, host, SMALL_BUCKETS)
    assert report.version == version + 1
    await assert_engines_serve(controller, host)


async def test_push_cancelled_mid_command_aborts_and_the_next_push_succeeds(stack) -> None:
    controller, host = stack["controller"], stack["host"]
    controller.health.pause()

    async def cancel_in_bucket(index: int) -> None:
        if index == 1:
            await asyncio.sleep(0.05)  # the POSTs and the broadcast of bucket 2 are on the wire
            asyncio.current_task().cancel()

    push = asyncio.create_task(
        push_full_weights(controller, host, SMALL_BUCKETS, on_bucket_in_flight=cancel_in_bucket)
    )
    with pytest.raises(asyncio.CancelledError):
        await push
    assert_aborted_cleanly(controller, health_running=False)
    controller.health.resume()
    await push_full_weights(controller, host, SMALL_BUCKETS)
    await assert_engines_serve(controller, host)


async def test_cancelled_while_waiting_for_a_restarting_engine(stack) -> None:
    controller, host = stack["controller"], stack["host"]
    controller.health.pause()  # this test restarts the engine itself
    cell = controller.cells[1]
    engine_pid = await cell.actor.pid.remote()
    os.kill(engine_pid, 9)  # the engine dies -> its actor ends itself (fate sharing)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            await cell.actor.pid.remote()
            await asyncio.sleep(0.1)
    cell.mark_failed("engine process killed by the test")
    restart = asyncio.create_task(cell.restart())
    await asyncio.sleep(0.1)
    assert cell.state is CellState.STARTING

    push = asyncio.create_task(push_full_weights(controller, host, SMALL_BUCKETS))
    await asyncio.sleep(0.6)
    assert not push.done() and not controller.update_in_progress  # waiting with the lock released
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await push
    assert not controller.update_in_progress and controller.health.running is False
    await restart
    assert cell.state is CellState.PENDING_WEIGHTS and await cell.actor.pid.remote() != engine_pid
    controller.health.resume()
    await push_full_weights(controller, host, SMALL_BUCKETS)
    await assert_engines_serve(controller, host)


async def test_engine_killed_mid_push_is_respawned_and_gets_the_weights_before_serving(stack) -> None:
    """The engine's actor is killed while bucket 2 is in flight: the push aborts without hurting the
    trainer, the health checker respawns the engine and pushes the current weights before routing."""
    controller, full = stack["controller"], stack["full"]
    await full.run(ForwardBackward("full", TRAIN_BATCH, "cross_entropy", {}))
    await full.run(OptimStep("full", BIG_STEP))
    controller.set_weight_refresher(lambda ctrl: push_full_weights(ctrl, full, SMALL_BUCKETS))
    controller.start_health_checks()
    cell = controller.cells[0]
    engine_pid = await cell.actor.pid.remote()

    async def kill_engine(index: int) -> None:
        if index == 1:
            ray.kill(cell.actor, no_restart=True)  # the actor dies -> the kernel kills its engine

    with pytest.raises(Exception):  # noqa: B017 - transport error or WeightPushError, whichever comes first
        await push_full_weights(controller, full, SMALL_BUCKETS, on_bucket_in_flight=kill_engine)
    assert full.is_alive, "an engine failure must not mark the trainer errored"
    assert not controller.update_in_progress and controller.health.running
    for _ in range(300):
        await asyncio.sleep(0.1)
        if cell.starts == 2 and cell.state is CellState.READY:
            break
    await controller.health.wait_handled()
    assert cell.starts == 2 and cell.state is CellState.READY
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
    await assert_engines_serve(controller, full)


async def test_pushes_reuse_the_kept_group_until_an_engine_is_restarted(stack) -> None:
    """A push leaves its group joined and the next one reuses it (no join), still moving the new weights.
    After an engine is restarted (a new process that never joined) the push makes a fresh group, and the
    engine that kept running has left the old one."""
    from miles.engines.errors import EngineRefused

    controller, full = stack["controller"], stack["full"]
    controller.health.pause()
    first = await push_full_weights(controller, full, SMALL_BUCKETS)
    await full.run(ForwardBackward("full", TRAIN_BATCH, "cross_entropy", {}))
    await full.run(OptimStep("full", BIG_STEP))
    second = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert second.reused_group and second.group == first.group
    assert "join" in second.steps  # the trainer's Join still ran (its session), without a rendezvous
    await assert_engines_serve(controller, full)

    cell = controller.cells[1]
    cell.mark_failed("restarted by the test")
    await cell.restart()
    third = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert not third.reused_group and third.group != first.group
    await assert_engines_serve(controller, full)
    with pytest.raises(EngineRefused, match="does not exist"):
        await controller.cells[0].client.destroy_weights_update_group(first.group)
    fourth = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert fourth.reused_group and fourth.group == third.group
    await assert_engines_serve(controller, full)

    assert await drop_kept_group(controller, full)  # at shutdown: every member leaves
    for cell in controller.cells:
        with pytest.raises(EngineRefused, match="does not exist"):
            await cell.client.destroy_weights_update_group(third.group)
    fifth = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert not fifth.reused_group and fifth.group != third.group

    controller.kept_push_group = None  # a restarted driver knows no group; the trainer still names its own
    sixth = await push_full_weights(controller, full, SMALL_BUCKETS)
    assert not sixth.reused_group
    for cell in controller.cells:  # the engines left the group the trainer named
        with pytest.raises(EngineRefused, match="does not exist"):
            await cell.client.destroy_weights_update_group(fifth.group)
    controller.health.resume()


async def test_a_delta_push_over_http_and_ray_leaves_the_engines_serving_the_trainers_weights(stack) -> None:
    """The delta push through the real routes (update_weights_from_distributed with load_format
    miles_delta, /weights_checker) of two CPU engine processes: recorded, verified, then sent as deltas
    and verified again; the engines then give the trainer's logprobs. The model is float32, which the
    engines hold as sent (so the digests agree); its 16-bit words mostly change, so the forms may be
    dense: the path, not the bytes, is what this checks (test_delta_push.py checks the bytes)."""
    controller, full = stack["controller"], stack["full"]
    controller.health.pause()
    config = PushConfig(bucket_bytes=SMALL_BUCKETS.bucket_bytes, delta=True, delta_pace=False)
    first = await push_full_weights(controller, full, config)
    assert first.mode == "record" and first.verified and controller.delta_off is None
    await full.run(ForwardBackward("full", TRAIN_BATCH, "cross_entropy", {}))
    await full.run(OptimStep("full", BIG_STEP))
    second = await push_full_weights(controller, full, config)
    assert second.mode == "send" and second.verified and second.reused_group
    await assert_engines_serve(controller, full)
    controller.health.resume()
