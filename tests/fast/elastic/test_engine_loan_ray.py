"""A real borrow and return on real Ray (logical GPUs): a CPU engine cell is drained, its process stopped,
a hybrid lane is scheduled on the engine's own placement-group bundle (Ray places it only once the engine
gave the GPU back), trains on the core's trajectory, leaves, and the engine comes back READY with the
current weights. An engine with a request running is not drained (kept serving, shortfall recorded), and
a borrow that would break the rollout reserve touches nothing."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.cluster.placement import create_gpu_placement_group
from miles.elastic.engine_port import EngineCellPort
from miles.elastic.lane_port import BundleLanePort, RemoteLane
from miles.elastic.ledger import Gpu, GpuLedger, LoanState
from miles.elastic.loans import LoanExecutor
from miles.engines.config import EngineConfig
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.hybrid.coordinator import HybridTrainer, Lane
from miles.train.hybrid.state import state_entries
from miles.types import AdamParams, Datum
from tests.fast.local_ray import init_local_ray

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

RUN = "run-engine-loan"
ADAM = AdamParams(
    learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=1.0
)  # as in test_hybrid_lanes_on_ray.py
PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11]


def batch(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 3, 8, 5):
        tokens = rng.integers(0, 1024, n + 1).astype(np.int64)
        weights = rng.uniform(0.0, 1.0, n).astype(np.float32)
        out.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return out


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=6, num_gpus=3)
    yield
    ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(ray_session, tiny_model_dir: Path):
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    config = EngineConfig(model_path=str(tiny_model_dir), num_cpus=1, startup_timeout_s=120)
    cells = [EngineCell(i, config, (pg, 1 + i)) for i in range(2)]
    controller = InferenceController(cells)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    core = Lane(
        "core", RemoteLane.options(num_cpus=1, num_gpus=1, scheduling_strategy=strategy).remote("core")
    )
    await asyncio.gather(controller.start(), core.actor.setup.remote(RUN, str(tiny_model_dir), "full"))
    await controller.refresh_weights()  # the engines serve the base weights from disk: READY
    trainer = HybridTrainer(RUN, core, call_timeout_s=90)
    await trainer.start()
    ledger = GpuLedger(min_rollout_gpus=1)
    for cell in cells:
        ledger.add_engine(f"e{cell.index}", [Gpu("local", 1 + cell.index)])
    ports = {f"e{cell.index}": EngineCellPort(controller, cell) for cell in cells}
    lanes = BundleLanePort(
        pg, {"e0": 1, "e1": 2}, run=RUN, model_path=str(tiny_model_dir), train_mode="full", group_timeout_s=10
    )
    loans = LoanExecutor(ledger, trainer, lanes, ports, drain_timeout_s=0.5)
    yield {"controller": controller, "cells": cells, "trainer": trainer, "loans": loans, "ledger": ledger}
    await controller.stop()
    remove_placement_group(pg)


async def train_step(trainer: HybridTrainer, reference: TransformersBackend, seed: int) -> None:
    """One step on the lanes and on the one-lane reference; every lane's state equals the reference's."""
    data = batch(seed)
    await trainer.forward_backward("m", data, "cross_entropy", {})
    reference.forward_backward("m", data, "cross_entropy", {})
    await trainer.optim_step("m", ADAM)
    reference.optim_step("m", ADAM)
    want = {name: t.detach().numpy() for name, t in state_entries(reference, "m")}
    for lane in trainer.lanes:
        got = await lane.actor.snapshot.remote("m")
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, atol=1e-6, rtol=1e-6, err_msg=f"{lane.name} {name}")


async def test_an_engine_with_a_request_running_is_not_drained_and_keeps_serving(stack) -> None:
    cell, loans = stack["cells"][0], stack["loans"]
    long = {"max_new_tokens": 1500, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    rid = uuid.uuid4().hex
    running = asyncio.create_task(cell.client.generate(input_ids=PROMPT, sampling_params=long, rid=rid))
    await asyncio.sleep(1.0)
    outcome = await loans.borrow("e0")
    await cell.client.abort_request(rid=rid)
    await asyncio.gather(running, return_exceptions=True)
    assert not outcome.ok and "still had requests running" in outcome.reason
    assert cell.state is CellState.READY and stack["ledger"].loans["e0"].state is LoanState.SERVING
    assert stack["ledger"].shortfalls and "e0" in stack["ledger"].shortfalls[0]


async def test_borrow_train_and_return_keeps_the_trajectory_and_the_engine_serves_again(
    stack, tiny_model_dir: Path
) -> None:
    trainer, loans, controller = stack["trainer"], stack["loans"], stack["controller"]
    cell = stack["cells"][1]
    reference = TransformersBackend(str(tiny_model_dir), train_mode="full")
    await train_step(trainer, reference, 1)
    async with controller.weight_update(base_weights=False):  # the bracket: no push or probe meanwhile
        lent = await loans.borrow("e1")
    assert lent.ok, lent.reason
    assert list(lent.phases) == ["drain", "free", "start", "state_transfer"]
    assert cell.state is CellState.LENT and controller.ready_cells() == [stack["cells"][0]]
    assert stack["ledger"].owners()[Gpu("local", 2)] == "lane:lane-e1"
    refused = await loans.borrow("e0")  # would leave no rollout GPU
    assert not refused.ok and "min_rollout_gpus" in refused.reason
    assert stack["cells"][0].state is CellState.READY
    trainer.pinned_speeds = {"core": 1.0, "lane-e1": 1.0}
    await train_step(trainer, reference, 2)
    await train_step(trainer, reference, 3)
    back = await loans.give_back("e1")
    assert back.ok, back.reason
    assert [lane.name for lane in trainer.lanes] == ["core"]
    assert cell.state is CellState.READY and stack["ledger"].owners()[Gpu("local", 2)] == "engine:e1"
    out = await cell.client.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0.0}
    )
    assert len(out["output_ids"]) == 2
    await train_step(trainer, reference, 4)
