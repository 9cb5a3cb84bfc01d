"""The elastic driver's own rules, without Ray: what it observes (the gateway's queue, sampling in flight
per engine and when sampling was last seen), and when it does not decide at all (a step open, an engine
starting or waiting for weights). Real engine cells (never started), a real InferenceController, ledger,
policy and HybridTrainer; no lane is ever called, since no decision is taken or carried out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.contract.preset.runtime import ElasticOptions
from miles.elastic.driver import ElasticDriver
from miles.elastic.ledger import Gpu, GpuLedger
from miles.elastic.loans import LoanExecutor
from miles.elastic.policy import ElasticController
from miles.elastic.routing import HybridRouter
from miles.engines.config import EngineConfig
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.rollout.load import SamplingLoad
from miles.train.cell import TrainerCell
from miles.train.controller import TrainerController
from miles.train.hybrid.coordinator import FbCall, HybridTrainer, Lane


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def driver_over(cells: list[EngineCell], clock: Clock) -> ElasticDriver:
    inference = InferenceController(cells)
    inference.load = SamplingLoad(clock)
    ledger = GpuLedger(min_rollout_gpus=1)
    for cell in cells:
        ledger.add_engine(cell.name, [Gpu("n1", cell.index)])
    hybrid = HybridTrainer("run", Lane("core", actor=None))
    policy = ElasticController(ElasticOptions(enabled=True, idle_window_s=5.0), ledger)
    loans = LoanExecutor(ledger, hybrid, lanes=None, engines={})  # type: ignore[arg-type]
    router = HybridRouter(TrainerController([TrainerCell(0)]), hybrid)
    return ElasticDriver(policy, loans, router, inference, asyncio.Lock(), clock=clock)


def ready(cell: EngineCell) -> EngineCell:
    for state in (CellState.STARTING, CellState.PENDING_WEIGHTS, CellState.READY):
        cell.transition(state)
    return cell


@pytest.fixture
def cells(tmp_path: Path) -> list[EngineCell]:
    config = EngineConfig(model_path=str(tmp_path))  # never started: no model is read
    return [ready(EngineCell(i, config)) for i in range(2)]


def test_observations_come_from_the_gateway_queue_and_the_sampling_load(cells: list[EngineCell]) -> None:
    clock = Clock()
    driver = driver_over(cells, clock)
    seen = driver.observe()
    assert (seen.training_waiting, seen.sampling_in_flight, seen.last_sampling_at) == (0, 0, None)
    driver.watch_training_queue(lambda: 3)
    load = driver.inference.load
    with load.track(cells[1].name), load.track(cells[1].name):
        seen = driver.observe(about_to_train=True)
        assert (seen.training_waiting, seen.sampling_in_flight) == (4, 2)  # the request about to run counts
        assert seen.busy_engines == frozenset({cells[1].name})
        clock.now = 107.0
    seen = driver.observe()
    assert seen.sampling_in_flight == 0 and seen.busy_engines == frozenset()
    assert seen.last_sampling_at == 107.0  # in flight until it ended: the idle window counts from there
    driver.router.hybrid._dead.add("lane-x")  # recovery dropped it mid-step: its engine goes back next
    assert driver.observe().dead_lanes == frozenset({"lane-x"})


async def test_no_decision_while_a_step_is_open_or_an_engine_is_not_settled(cells: list[EngineCell]) -> None:
    clock = Clock()
    driver = driver_over(cells, clock)
    driver.watch_training_queue(lambda: 1)
    hybrid = driver.router.hybrid
    hybrid._open_step["full"].append(FbCall("m", (), "cross_entropy", {}))  # a forward_backward ran
    assert await driver.decide() is None  # mid-step: membership may not change
    hybrid._open_step["full"].clear()
    cells[0].mark_pending()  # e.g. a respawned engine waiting for its weights
    assert await driver.decide() is None  # a bracket now could mark it ready without them
    assert driver.policy.counts == {}  # nothing was even decided
    cells[0].mark_ready()
    with driver.inference.load.track(cells[0].name):
        decision = await driver.decide()  # settled and at a boundary: decided (sampling: hold)
    assert decision is not None and (decision.action, decision.code) == ("hold", "engines_not_idle")
    assert driver.status()["engines"] == {cells[0].name: "serving", cells[1].name: "serving"}
