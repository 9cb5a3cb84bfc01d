"""What moves when colocated GPUs change sides (miles.runtime.colocation.ColocatedGpus), on the real
InferenceController and EngineCell state machine with the engines' HTTP faked: releases and resumes in
the right order, refusals kill only the engine that refused, a failed push marks no engine ready and frees
the update lock, and a respawn waits for the GPUs to be the engines' again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.engines.config import EngineConfig
from miles.errors import UnavailableError
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.rollout.health import HealthCheckConfig
from miles.runtime.colocation import ColocatedGpus, ColocationGate, ColocationPlan, GpuPhase
from miles.train.commands import PrepareForSampling, PrepareForTraining


class MemoryClient:
    """The engine's memory routes, recorded; `refuse` names a route that answers 400."""

    def __init__(self, log: list[str], name: str) -> None:
        self.base_url = f"http://{name}"
        self.log, self.name = log, name
        self.refuse: str | None = None

    async def health(self, timeout_s: float | None = None) -> bool:
        return True

    async def alive(self, timeout_s: float | None = None) -> bool:
        return True

    async def _route(self, route: str, tags: list[str]) -> None:
        if self.refuse == route:
            raise RuntimeError(f"{route} refused")
        self.log.append(f"{self.name} {route} {','.join(tags)}")

    async def release_memory_occupation(self, tags: list[str]) -> None:
        await self._route("release", tags)

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        await self._route("resume", tags)


class Cell(EngineCell):
    def __init__(self, index: int, config: EngineConfig, log: list[str]) -> None:
        super().__init__(index, config)
        self.log = log
        self.killed: str | None = None

    async def start(self) -> None:
        self.transition(CellState.STARTING)
        self.starts += 1
        self.client = MemoryClient(self.log, f"e{self.index}")  # type: ignore[assignment]
        self.transition(CellState.PENDING_WEIGHTS)

    async def restart(self) -> None:
        self.log.append(f"e{self.index} respawn")
        await self.start()

    def _kill_actor(self) -> None:
        self.killed = self.problem

    async def stop(self) -> None:
        self.transition(CellState.STOPPED)


class Trainer:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.commands: list[Any] = []

    async def run(self, command: Any) -> Any:
        self.log.append(f"trainer {command.name}")
        self.commands.append(command)
        return {}


@pytest.fixture
async def setup(tmp_path):
    log: list[str] = []
    config = EngineConfig(model_path=str(tmp_path))
    health = HealthCheckConfig(interval_s=0.02, timeout_s=0.5, failure_threshold=2)
    inference = InferenceController([Cell(i, config, log) for i in range(2)], health=health)
    await inference.start()
    async with inference.weight_update():
        pass  # bring-up's first weights: both READY
    pushes: list[str] = []

    async def push(then: Any) -> None:
        async with inference.weight_update() as update:
            pushes.append(",".join(c.name for c in update.engines))
            for cell in update.engines:
                await then(cell)

    plan = ColocationPlan(engine_release=("weights", "kv_cache"), trainer_offload=("optimizer",))
    switch = ColocatedGpus(plan, inference, Trainer(log), push)  # type: ignore[arg-type]
    gate = ColocationGate(switch, sampling_wait_s=5)
    inference.set_respawn_gate(lambda: gate.hold(GpuPhase.SAMPLING))
    yield inference, gate, log, pushes
    await inference.stop()


def states(inference: InferenceController) -> list[CellState]:
    return [cell.state for cell in inference.cells]


async def test_a_round_trip_releases_then_resumes_weights_before_the_push_and_kv_after(setup) -> None:
    inference, gate, log, pushes = setup
    async with gate.hold(GpuPhase.TRAINING):
        assert states(inference) == [CellState.RELEASED] * 2
        assert inference.ready_cells() == []
    assert log == [
        "e0 release weights,kv_cache",
        "e1 release weights,kv_cache",
        "trainer prepare_for_training",
    ]
    log.clear()
    async with gate.hold(GpuPhase.SAMPLING):
        assert states(inference) == [CellState.READY] * 2
    assert log == [
        "trainer prepare_for_sampling",
        "e0 resume weights",
        "e1 resume weights",
        "e0 resume kv_cache",  # after the push: the push has the KV cache's memory to work in
        "e1 resume kv_cache",
    ]
    assert pushes == ["engine cell 0,engine cell 1"]
    # the preset's offload reaches the trainer
    assert gate._switch._trainer.commands == [PrepareForTraining(), PrepareForSampling(("optimizer",))]


async def test_an_engine_that_refuses_to_release_is_killed_and_training_goes_on(setup) -> None:
    inference, gate, log, _ = setup
    inference.start_health_checks()
    inference.cells[1].client.refuse = "release"
    async with gate.hold(GpuPhase.TRAINING):
        assert inference.cells[0].state is CellState.RELEASED
        assert inference.cells[1].killed and "release_memory_occupation failed" in inference.cells[1].killed
        await asyncio.sleep(0.2)
        # its respawn would take GPU memory from the training step: it waits for the sampling side
        assert "e1 respawn" not in log
    async with gate.hold(GpuPhase.SAMPLING):
        pass
    for _ in range(100):
        if inference.cells[1].state is CellState.READY:
            break
        await asyncio.sleep(0.02)
    assert "e1 respawn" in log and states(inference) == [CellState.READY] * 2


async def test_resume_refused_by_every_engine_is_unavailable_and_unsettled(setup) -> None:
    inference, gate, _, pushes = setup
    async with gate.hold(GpuPhase.TRAINING):
        for cell in inference.cells:
            cell.client.refuse = "resume"
    with pytest.raises(UnavailableError, match="no engine could take its GPU memory back"):
        async with gate.hold(GpuPhase.SAMPLING):
            pass
    assert gate.phase is GpuPhase.UNSETTLED and pushes == []
    assert all(cell.state is CellState.FAILED for cell in inference.cells)


async def test_a_failed_push_marks_no_engine_ready_and_frees_the_update_lock(setup) -> None:
    inference, gate, _, _ = setup
    switch = gate._switch

    async def broken_push(then: Any) -> None:
        async with inference.weight_update():
            raise RuntimeError("update_weights_from_tensor: 400")

    switch._push = broken_push
    async with gate.hold(GpuPhase.TRAINING):
        pass
    with pytest.raises(RuntimeError, match="400"):
        async with gate.hold(GpuPhase.SAMPLING):
            pass
    assert inference.ready_cells() == [] and not inference.update_in_progress
    assert gate.phase is GpuPhase.UNSETTLED
    # the next training call settles the GPUs again: resumed-but-unpushed engines are released again
    async with gate.hold(GpuPhase.TRAINING):
        assert states(inference) == [CellState.RELEASED] * 2


async def test_a_push_that_failed_after_the_weights_resumed_does_not_resume_them_twice(setup) -> None:
    inference, gate, log, _ = setup
    switch = gate._switch
    working_push = switch._push
    calls = {"n": 0}

    async def push_failing_once(then: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            async with inference.weight_update():
                raise RuntimeError("update_weights_from_tensor: 400")
        await working_push(then)

    switch._push = push_failing_once
    async with gate.hold(GpuPhase.TRAINING):
        pass
    log.clear()
    with pytest.raises(RuntimeError, match="400"):
        async with gate.hold(GpuPhase.SAMPLING):
            pass
    assert log == ["trainer prepare_for_sampling", "e0 resume weights", "e1 resume weights"]
    log.clear()
    async with gate.hold(GpuPhase.SAMPLING):  # weights are back already: only the KV cache is resumed
        assert states(inference) == [CellState.READY] * 2
    assert log == ["trainer prepare_for_sampling", "e0 resume kv_cache", "e1 resume kv_cache"]
    log.clear()
    async with gate.hold(GpuPhase.TRAINING):  # and released again in full
        pass
    assert log[:2] == ["e0 release weights,kv_cache", "e1 release weights,kv_cache"]


async def test_releasing_nothing_sends_no_empty_tag_list(setup) -> None:
    """SGLang reads an empty or absent tag list as every tag."""
    inference, gate, log, _ = setup
    gate._switch.plan = ColocationPlan(engine_release=(), trainer_offload=())
    async with gate.hold(GpuPhase.TRAINING):
        assert states(inference) == [CellState.RELEASED] * 2  # out of routing all the same
    async with gate.hold(GpuPhase.SAMPLING):
        assert states(inference) == [CellState.READY] * 2
    assert [line for line in log if "release" in line or "resume" in line] == []


async def test_lora_resumes_the_kv_cache_without_a_push_and_keeps_ready_engines_serving(tmp_path) -> None:
    log: list[str] = []
    config = EngineConfig(model_path=str(tmp_path))
    inference = InferenceController([Cell(i, config, log) for i in range(2)])
    await inference.start()
    async with inference.weight_update():
        pass
    plan = ColocationPlan(engine_release=("kv_cache",), trainer_offload=())
    gate = ColocationGate(ColocatedGpus(plan, inference, Trainer(log), None), sampling_wait_s=5)  # type: ignore[arg-type]
    async with gate.hold(GpuPhase.TRAINING):
        pass
    async with gate.hold(GpuPhase.SAMPLING):
        assert states(inference) == [CellState.READY] * 2
    memory = [line for line in log if "release" in line or "resume" in line]
    assert memory == [f"e{i} {verb} kv_cache" for verb in ("release", "resume") for i in (0, 1)]
    await inference.stop()


async def test_without_an_offload_the_switches_skip_the_trainer_and_time_their_steps(setup) -> None:
    inference, gate, log, pushes = setup
    switch = gate._switch
    switch.plan = ColocationPlan(engine_release=("weights", "kv_cache"), trainer_offload=())
    to_training = await switch(GpuPhase.TRAINING)
    to_sampling = await switch(GpuPhase.SAMPLING)
    assert not [line for line in log if line.startswith("trainer")]  # nothing moved, nothing to ask
    assert set(to_training) == {"release"} and set(to_sampling) == {"resume", "push"}
    assert pushes == ["engine cell 0,engine cell 1"] and states(inference) == [CellState.READY] * 2
