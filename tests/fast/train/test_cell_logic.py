"""Pure parts of the cell/controller layer: lifecycle table, error unwrapping, routing, what an errored
cell does to the commands on its channels (no Ray)."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
import torch
from ray.exceptions import ActorDiedError, RayTaskError

from miles.errors import UserError
from miles.train.cell import TRANSITIONS, IllegalTransition, TrainerCell, TrainerCellState
from miles.train.channel import ChannelServer, CommandChannel, new_key
from miles.train.commands import ModelKeys, TrainerCommand
from miles.train.controller import TrainerController
from miles.train.errors import RemoteCommandError, TrainerUnavailableError


def ray_task_error(cause: Exception) -> RayTaskError:
    try:
        raise cause
    except Exception as exc:
        import traceback

        return RayTaskError("forward_backward", traceback.format_exc(), exc)


def test_every_state_is_in_the_table_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(TrainerCellState)
    assert TRANSITIONS[TrainerCellState.STOPPED] == frozenset()
    assert all(
        TrainerCellState.STOPPED in allowed
        for state, allowed in TRANSITIONS.items()
        if state is not TrainerCellState.STOPPED
    )


def test_illegal_transitions_are_refused() -> None:
    cell = TrainerCell(3)
    with pytest.raises(IllegalTransition, match="trainer cell 3: new -> alive"):
        cell._transition(TrainerCellState.ALIVE)
    cell._transition(TrainerCellState.STARTING)
    cell._transition(TrainerCellState.ALIVE)
    with pytest.raises(IllegalTransition):
        cell._transition(TrainerCellState.STARTING)


@pytest.mark.parametrize("dual", [False, True])
def test_ray_task_error_is_unwrapped_to_the_user_exception(dual: bool) -> None:
    wrapped = ray_task_error(UserError("datum 2: target_tokens must hold integer token ids"))
    exc = wrapped.as_instanceof_cause() if dual else wrapped
    error = RemoteCommandError.from_exception("forward_backward", exc)
    assert error.cause_type == "UserError"
    assert error.cause_message == "datum 2: target_tokens must hold integer token ids"
    assert error.is_user_error
    assert "raise cause" in error.remote_traceback
    assert str(error) == "trainer command forward_backward failed: UserError: " + error.cause_message


def test_other_exceptions_are_server_errors_and_actor_errors_keep_their_type() -> None:
    error = RemoteCommandError.from_exception("save_state", ray_task_error(OSError(28, "No space left")))
    assert (error.cause_type, error.is_user_error) == ("OSError", False)
    died = RemoteCommandError.from_exception("optim_step", ActorDiedError())
    assert died.cause_type == "ActorDiedError" and not died.is_user_error
    assert died.cause.startswith("ActorDiedError: The actor died")


def test_errors_survive_pickling() -> None:
    error = RemoteCommandError("m", "UserError", "bad", "tb", is_user_error=True)
    again = pickle.loads(pickle.dumps(error))
    assert (again.cause_type, again.cause_message, again.remote_traceback, again.is_user_error) == (
        "UserError",
        "bad",
        "tb",
        True,
    )
    unavailable = pickle.loads(pickle.dumps(TrainerUnavailableError("ping", "trainer cell 0 errored")))
    assert (
        isinstance(unavailable, TrainerUnavailableError)
        and unavailable.cause_message == "trainer cell 0 errored"
    )


class RecordingCell(TrainerCell):
    """A cell whose commands are answered locally (routing only)."""

    def __init__(self, index: int, alive: bool) -> None:
        super().__init__(index)
        self.calls: list[str] = []
        if alive:
            self._transition(TrainerCellState.STARTING)
            self._transition(TrainerCellState.ALIVE)

    async def _all_ranks(self, what, submit):
        self.calls.append(what)
        return [f"cell {self.index}"]


async def test_controller_uses_the_first_alive_cell_and_reports_why_none_is() -> None:
    dead, alive = RecordingCell(0, alive=False), RecordingCell(1, alive=True)
    controller = TrainerController([dead, alive])
    assert await controller.run(ModelKeys()) == "cell 1"
    assert alive.calls == ["model_keys"] and dead.calls == []
    alive._mark_errored(RemoteCommandError("ping", "ActorDiedError", "gone"))
    assert not controller.has_alive_cell()
    assert (
        controller.health_problem() == "trainer cell 0 is new; trainer cell 1 errored: ActorDiedError: gone"
    )
    with pytest.raises(TrainerUnavailableError, match="trainer cell 1 errored"):
        await controller.run(ModelKeys())
    await controller.stop()
    assert {dead.state, alive.state} == {TrainerCellState.STOPPED}


class WeightCount(TrainerCommand[int]):
    """A rank-0 command like the weight push's steps: it reads the backend's HF weights."""

    rank0_only = True

    def run(self, backend) -> int:
        return sum(tensor.numel() for _, tensor in backend.iter_hf_weights())


def test_worker_runs_commands_on_its_backend_and_rank_0_commands_on_rank_0_only(tiny_model_dir) -> None:
    from miles.train.worker import TrainerWorker

    rank0 = TrainerWorker(0, 1)
    info = rank0.setup(None, str(tiny_model_dir), "full", {"dtype": "float32"})
    assert info["device"] == "cpu" and info["rank"] == 0
    assert rank0.execute(ModelKeys()) == ["full"]
    assert rank0.execute(WeightCount()) > 1024 * 64  # lm_head alone is 1024 x 64
    assert TrainerWorker(1, 2).execute(WeightCount()) is None  # never touches its (absent) backend


def test_command_names_are_derived_from_their_class() -> None:
    from miles.train.commands import ForwardBackward, OptimStep, StageHfWeights

    assert ForwardBackward("k", [], "cross_entropy", {}).name == "forward_backward"
    assert OptimStep("k", None).name == "optim_step"  # type: ignore[arg-type]
    assert StageHfWeights(None).name == "stage_hf_weights"  # type: ignore[arg-type]


def test_unknown_dtype_names_are_user_errors() -> None:
    from miles.train.worker import resolve_dtype

    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(UserError, match="unknown torch dtype 'bf17'"):
        resolve_dtype("bf17")


async def test_a_cell_errored_by_a_probe_ends_its_channel_commands_at_once() -> None:
    """A rank whose node vanished leaves its channel silent (no reset, no answer); the probe that finds
    the rank dead must not leave the command waiting for TCP keep-alive. The rank here is a channel
    server on a thread that never answers."""
    release = threading.Event()
    key = new_key()
    server = ChannelServer(key, "127.0.0.1", lambda command: release.wait(60))
    cell = TrainerCell(4)
    cell._transition(TrainerCellState.STARTING)
    cell._transition(TrainerCellState.ALIVE)
    cell._channels = [await CommandChannel.connect(0, server.address, key)]
    assert cell.command_path == "channel"
    command = asyncio.create_task(cell.run(ModelKeys()))
    await asyncio.sleep(0.2)
    assert not command.done()
    cell._mark_errored(RemoteCommandError("ping", "ActorDiedError", "its node was lost"))
    with pytest.raises(RemoteCommandError, match="ChannelLost"):
        await asyncio.wait_for(command, 5)  # the rank would answer after 60 s, keep-alive after minutes
    assert cell.problem() == "trainer cell 4 errored: ActorDiedError: its node was lost"
    assert cell.command_path == "actor calls"
    release.set()
    server.close()
