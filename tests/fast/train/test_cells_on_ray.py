"""Trainer cells on a real local Ray cluster with logical GPUs (one Ray session for the module).

Two cells: a 2-rank full-model cell (data parallel over a real gloo group) and a 1-rank LoRA cell; a spare
bundle for a cell that fails to start. The tests run in file order; later ones kill or break the cells on
purpose.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from safetensors.torch import load_file

from miles.train import write_behind
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.cell import TrainerCell, TrainerCellState
from miles.train.channel import CommandChannel
from miles.train.commands import (
    CreateAdapter,
    ExportAdapter,
    ForwardBackward,
    HasAdapter,
    ModelKeys,
    OptimStep,
    SaveState,
    Sleep,
    StageHfWeights,
)
from miles.train.controller import TrainerController
from miles.train.errors import RemoteCommandError, TrainerUnavailableError
from miles.types import AdamParams, Datum, LoraSpec
from tests.fast.local_ray import init_local_ray

VOCAB = 1024
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=2.0)


def make_batch(loss_fn: str, seed: int, lengths: tuple[int, ...]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    batch = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1).astype(np.int64)
        inputs: dict[str, np.ndarray] = {"target_tokens": tokens[1:]}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0.0, 1.0, n).astype(np.float32)
        else:
            inputs["logprobs"] = (-np.log(VOCAB) + rng.normal(0.0, 0.2, n)).astype(np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, n).astype(np.float32)
        batch.append(Datum(tokens[:-1], inputs))
    return batch


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    temp_dir = tmp_path_factory.mktemp("ray")
    init_local_ray(temp_dir, num_cpus=4, num_gpus=4)
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 4)  # 0-1: DP cell, 2: LoRA cell, 3: spare
    ray.get(pg.ready(), timeout=120)
    yield pg
    remove_placement_group(pg)
    ray.shutdown()


@pytest.fixture(scope="module")
def cells(ray_session, tiny_model_dir: Path):
    pg = ray_session
    dp = TrainerCell(0, user_error_grace_s=20, collective_timeout_s=60)
    lora = TrainerCell(1, command_channel=False)  # the actor-call path, which the dp cell no longer takes

    async def start() -> None:
        await asyncio.gather(
            dp.start([(pg, 0), (pg, 1)], model_path=str(tiny_model_dir), train_mode="full"),
            lora.start([(pg, 2)], model_path=str(tiny_model_dir), train_mode="lora", dtype="float32"),
        )

    asyncio.run(start())
    yield dp, lora
    asyncio.run(TrainerController([dp, lora]).stop())


async def test_two_rank_data_parallel_equals_one_rank(cells, tiny_model_dir: Path, tmp_path: Path) -> None:
    dp, _ = cells
    assert dp.command_path == "channel"
    assert [info["rank"] for info in dp.ranks_info] == [0, 1]
    assert dp.ranks_info[0]["pid"] != dp.ranks_info[1]["pid"]
    single = TransformersBackend(str(tiny_model_dir), train_mode="full")
    ce = make_batch("cross_entropy", 1, (6, 4, 9, 5, 7))  # 5 datums: shares of 3 and 2
    ppo = make_batch("ppo", 2, (8, 3, 5))
    lone = make_batch("importance_sampling", 6, (4,))  # rank 1's share is empty
    for step in range(2):
        for batch, loss_fn in ((ce, "cross_entropy"), (ppo, "ppo"), (lone, "importance_sampling")):
            ours = await dp.run(ForwardBackward("full", batch, loss_fn, {}))
            ref = single.forward_backward("full", batch, loss_fn, {})
            assert len(ours.logprobs) == len(batch)
            for i in range(len(batch)):
                np.testing.assert_allclose(ours.logprobs[i], ref.logprobs[i], atol=1e-5, rtol=1e-5)
                np.testing.assert_allclose(
                    ours.elementwise_loss[i], ref.elementwise_loss[i], atol=1e-5, rtol=1e-5
                )
            assert ours.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        ours_step = await dp.run(OptimStep("full", ADAM))
        ref_step = single.optim_step("full", ADAM)
        assert ours_step["grad_norm:mean"] == pytest.approx(ref_step["grad_norm:mean"], rel=1e-5), step

    assert await dp.run(StageHfWeights(tmp_path / "dp")) is True  # rank 0 writes behind, in its process
    await write_behind.wait_written(tmp_path / "dp", dp.problem, 60)
    exported = load_file(str(tmp_path / "dp" / "model.safetensors"))
    for name, param in single.named_trainable_parameters("full"):
        torch.testing.assert_close(exported[name], param.detach(), atol=1e-5, rtol=1e-5, msg=name)


async def test_a_bad_datum_in_rank_1s_share_fails_on_every_rank_and_the_next_batch_trains(cells) -> None:
    dp, _ = cells
    batch = make_batch("cross_entropy", 3, (5, 6, 7, 8))
    batch[3].loss_fn_inputs["weights"] = batch[3].loss_fn_inputs["weights"][:-1]  # rank 1 holds datums 2-3
    command = ForwardBackward("full", batch, "cross_entropy", {})
    refs = [actor.execute.remote(command) for actor in dp.actors]
    for rank, ref in enumerate(refs):
        with pytest.raises(Exception, match="datum 3") as caught:
            await asyncio.wait_for(ref, 60)
        assert type(caught.value).__name__ == "RayTaskError(UserError)", rank

    with pytest.raises(RemoteCommandError) as caught:
        await asyncio.wait_for(dp.run(command), 60)
    error = caught.value
    assert error.is_user_error and error.cause_type == "UserError"
    assert "datum 3" in error.cause_message and "preflight" in error.remote_traceback
    assert dp.is_alive

    good = make_batch("cross_entropy", 4, (5, 6, 7))
    before = await dp.run(ForwardBackward("full", good, "cross_entropy", {}))
    await dp.run(OptimStep("full", AdamParams(learning_rate=5e-3)))
    after = await dp.run(ForwardBackward("full", good, "cross_entropy", {}, forward_only=True))
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"]


async def test_lora_cell_trains_named_adapters(cells, tmp_path: Path) -> None:
    _, lora = cells
    assert lora.command_path == "actor calls"
    await lora.run(CreateAdapter("sess:train:0", LoraSpec(rank=4, seed=1)))
    assert await lora.run(HasAdapter("sess:train:0"))
    batch = make_batch("cross_entropy", 5, (6, 6))
    first = await lora.run(ForwardBackward("sess:train:0", batch, "cross_entropy", {}))
    await lora.run(OptimStep("sess:train:0", AdamParams(learning_rate=2e-2)))
    second = await lora.run(ForwardBackward("sess:train:0", batch, "cross_entropy", {}, forward_only=True))
    assert second.metrics["loss:sum"] < first.metrics["loss:sum"]
    await lora.run(ExportAdapter("sess:train:0", tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


async def test_liveness_probe_is_answered_while_a_command_runs(cells) -> None:
    dp, _ = cells
    command = asyncio.create_task(dp.run(Sleep(4)))
    await asyncio.sleep(0.5)
    assert await dp.probe(timeout_s=2.0)  # the health concurrency group answers mid-command
    assert not command.done()
    assert await command is None
    assert dp.is_alive


async def test_killing_a_rank_mid_command_marks_the_cell_errored_at_once(cells) -> None:
    dp, lora = cells
    controller = TrainerController([dp, lora])
    command = asyncio.create_task(dp.run(Sleep(60)))
    await asyncio.sleep(1.0)
    rank0 = dp.actors[0]
    ray.kill(dp.actors[1], no_restart=True)
    with pytest.raises(RemoteCommandError) as caught:
        await asyncio.wait_for(command, 30)
    assert caught.value.cause_type == "ActorDiedError"
    assert dp.state is TrainerCellState.ERRORED
    # errored while rank 0 is still inside its command: the cell did not wait for the other ranks
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(rank0.execute.remote(ModelKeys()), 1.0)
    problem = dp.problem()
    assert problem is not None and problem.startswith("trainer cell 0 errored: ActorDiedError:")
    with pytest.raises(TrainerUnavailableError, match="trainer cell 0 errored"):
        await dp.run(ModelKeys())
    # the controller routes to the next alive cell
    assert controller.has_alive_cell() and controller.health_problem() is None
    assert await controller.run(ModelKeys()) == ["sess:train:0"]
    await dp.stop()
    assert dp.state is TrainerCellState.STOPPED


async def test_a_server_side_failure_reaches_the_caller_and_healthz(cells, tmp_path: Path) -> None:
    dp, lora = cells
    controller = TrainerController([dp, lora])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RemoteCommandError) as caught:
        await controller.run(SaveState("sess:train:0", blocker / "ckpt", with_optimizer=True))
    error = caught.value
    assert not error.is_user_error
    assert error.cause_type in {"FileExistsError", "NotADirectoryError"}
    assert str(blocker) in error.cause_message
    assert "save_state" in error.remote_traceback and "transformers_backend.py" in error.remote_traceback
    assert not controller.has_alive_cell()
    problem = controller.health_problem()
    assert problem is not None
    assert "trainer cell 0 stopped: ActorDiedError" in problem
    assert f"trainer cell 1 errored: {error.cause_type}" in problem
    with pytest.raises(TrainerUnavailableError):
        await controller.run(ModelKeys())


async def test_a_cell_that_cannot_load_its_model_reports_why(ray_session, tmp_path: Path) -> None:
    cell = TrainerCell(7, start_timeout_s=120)
    missing = tmp_path / "no-such-model"
    with pytest.raises(RemoteCommandError) as caught:
        await cell.start([(ray_session, 3)], model_path=str(missing), train_mode="lora")
    assert not caught.value.is_user_error
    assert str(missing) in caught.value.cause_message
    assert cell.state is TrainerCellState.STOPPED and cell.actors == []
    problem = cell.problem()
    assert problem is not None and problem.startswith(f"trainer cell 7 stopped: {caught.value.cause_type}")


async def test_a_rank_killed_while_idle_is_noticed_by_the_probe(ray_session, tiny_model_dir: Path) -> None:
    cell = TrainerCell(8)
    await cell.start([(ray_session, 3)], model_path=str(tiny_model_dir), train_mode="lora")
    controller = TrainerController([cell])
    assert await controller.probe_cells() and controller.health_problem() is None
    ray.kill(cell.actors[0], no_restart=True)
    for _ in range(20):  # Ray reports the death asynchronously
        if not await controller.probe_cells(timeout_s=2.0):
            break
        await asyncio.sleep(0.25)
    assert not controller.has_alive_cell()
    assert "trainer cell 8 errored: ActorDiedError" in (controller.health_problem() or "")
    await cell.stop()


async def test_a_rank_that_dies_while_idle_errors_the_cell_without_a_probe_call(
    ray_session, tiny_model_dir: Path
) -> None:
    """The rank's command channel ends with its process: the cell probes at once, not on the next tick."""
    cell = TrainerCell(9)
    await cell.start([(ray_session, 3)], model_path=str(tiny_model_dir), train_mode="lora")
    assert cell.command_path == "channel" and cell.is_alive
    ray.kill(cell.actors[0], no_restart=True)
    for _ in range(40):
        if not cell.is_alive:
            break
        await asyncio.sleep(0.25)
    problem = cell.problem()
    assert problem is not None and problem.startswith("trainer cell 9 errored: ActorDiedError"), problem
    await cell.stop()


async def test_a_channel_that_cannot_open_leaves_the_actor_calls_serving(
    ray_session, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As where a firewall lets the driver reach the ranks on Ray's ports only."""

    async def refused(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(CommandChannel, "connect", refused)
    cell = TrainerCell(10)
    with caplog.at_level(logging.WARNING, logger="miles.train.cell"):
        await cell.start([(ray_session, 3)], model_path=str(tiny_model_dir), train_mode="lora")
    assert cell.is_alive and cell.command_path == "actor calls"
    assert "trainer cell 10: no command channel (ConnectionRefusedError" in caplog.text
    await cell.run(CreateAdapter("sess:train:0", LoraSpec(rank=4, seed=1)))
    assert await cell.run(HasAdapter("sess:train:0"))
    assert cell.command_path == "actor calls"  # not tried again per command
    await cell.stop()
