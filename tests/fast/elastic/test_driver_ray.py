"""The elastic driver in a job's runtime, on real Ray (logical GPUs) with CPU engines and the real trainer
cell: the first forward_backward of a step finds the engines idle and a training request waiting, so an
engine is lent before it runs; the lane trains on the one-lane trajectory (the core is the trainer cell's
rank 0); a snapshot is published during the loan (a full-weight push reaches the serving engine only);
once the training queue drains the lane is given back and the returned engine serves exactly the
trainer's weights, the published snapshot still servable. Decisions reach the metrics registry and the
status the gateway shows. An engine with a request running is not drained (it keeps serving, the
shortfall is recorded), and a borrow that would break the rollout reserve touches nothing."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import ray
from prometheus_client import CollectorRegistry
from ray.util.placement_group import remove_placement_group

from miles.cluster.ordering import BundleLocation
from miles.cluster.placement import create_gpu_placement_group
from miles.contract.preset.runtime import ElasticOptions
from miles.driver.elastic import start_elastic
from miles.elastic.ledger import LoanState
from miles.engines.config import EngineConfig
from miles.rollout.cell_state import CellState
from miles.runtime.layout import Layout
from miles.runtime.model_cells import CellSettings, serve_model_cells, start_model_cells
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, SamplerTarget
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.hybrid.state import state_entries
from miles.types import AdamParams, Datum, LogprobSpec, SamplingParams
from tests.fast.local_ray import init_local_ray

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BASE = "tiny/base"
ADAM = AdamParams(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=1.0)  # docs/elastic.md
PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11]
LENT, KEPT = "engine cell 0", "engine cell 1"  # the first idle engine by name is lent


def batch(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 3, 8, 5):
        tokens = rng.integers(0, 1024, n + 1).astype(np.int64)
        weights = rng.uniform(0.0, 1.0, n).astype(np.float32)
        out.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return out


def prompt_datum() -> Datum:
    ids = np.asarray(PROMPT, dtype=np.int64)
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, dtype=np.float32)})


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=6, num_gpus=3)
    yield
    ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def job(ray_session, tiny_model_dir: Path):
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    ip = ray.util.get_node_ip_address()
    layout = Layout(
        trainer=[BundleLocation(0, ip, 0)], engines=[[BundleLocation(1, ip, 1)], [BundleLocation(2, ip, 2)]]
    )
    engine = EngineConfig(model_path=str(tiny_model_dir), num_cpus=1, startup_timeout_s=120)
    settings = CellSettings(tiny_model_dir, "full", engine, trainer_dtype="float32", max_batch_tokens=4096)
    cells = await start_model_cells(pg, layout, settings)
    card = ModelCard(BASE, 128, True, True, "full", str(tiny_model_dir))
    runtime = await serve_model_cells(
        card, cells, push=_push(), max_loaded_adapters=4, lora_batch_window_s=0.0
    )
    registry = CollectorRegistry()
    driver = await start_elastic(
        # min_loan_s 0: the return comes as soon as the queue drains, inside this test
        ElasticOptions(
            enabled=True, min_rollout_gpus=1, idle_window_s=0.0, max_hybrid_lanes=1, min_loan_s=0.0
        ),
        runtime,
        run="run-driver",
        model_path=str(tiny_model_dir),
        lane_kwargs={"dtype": "float32"},
        registry=registry,
        poll_s=3600,  # decisions come from the commands here, not the idle poller
        drain_timeout_s=0.5,
    )
    yield {"runtime": runtime, "driver": driver, "registry": registry, "cells": cells.engines}
    await runtime.close()
    remove_placement_group(pg)


def _push() -> Any:
    from miles.weights.push import PushConfig

    return PushConfig(bucket_bytes=1 << 20, group_timeout_s=60, cleanup_timeout_s=20)


async def train_step(runtime: Any, reference: TransformersBackend, seed: int) -> None:
    """One step through the runtime and on the one-lane reference; every lane equals the reference."""
    data = batch(seed)
    got = await runtime.forward_backward(ForwardBackwardRequest("m", data, "cross_entropy", {}, False))
    want = reference.forward_backward("m", data, "cross_entropy", {})
    np.testing.assert_allclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rtol=1e-6)
    await runtime.optim_step(OptimStepRequest("m", ADAM))
    reference.optim_step("m", ADAM)
    expected = {name: t.detach().numpy() for name, t in state_entries(reference, "m")}
    for lane in runtime.elastic.router.hybrid.lanes:
        state = await lane.actor.snapshot.remote("m")
        for name, value in expected.items():
            np.testing.assert_allclose(
                state[name], value, atol=1e-6, rtol=1e-6, err_msg=f"{lane.name} {name}"
            )


async def engine_logprobs(client: Any) -> np.ndarray:
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return np.asarray([p[0] for p in out["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


async def test_an_engine_with_a_request_running_is_not_drained_and_keeps_serving(job) -> None:
    driver, cell = job["driver"], job["cells"][0]
    long = {"max_new_tokens": 1500, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    rid = uuid.uuid4().hex
    running = asyncio.create_task(cell.client.generate(input_ids=PROMPT, sampling_params=long, rid=rid))
    await asyncio.sleep(1.0)
    outcome = await driver.loans.borrow(LENT)
    await cell.client.abort_request(rid=rid)
    await asyncio.gather(running, return_exceptions=True)
    assert not outcome.ok and "still had requests running" in outcome.reason
    assert cell.state is CellState.READY and driver.ledger.loans[LENT].state is LoanState.SERVING
    assert driver.ledger.shortfalls and LENT in driver.ledger.shortfalls[0]
    assert driver.status()["shortfalls"] == driver.ledger.shortfalls


async def test_a_job_borrows_trains_publishes_and_returns_an_engine_serving_the_trainers_weights(
    job, tiny_model_dir: Path, tmp_path: Path
) -> None:
    runtime, driver, registry = job["runtime"], job["driver"], job["registry"]
    lent_cell, kept_cell = job["cells"]
    hybrid, ledger = driver.router.hybrid, driver.ledger
    reference = TransformersBackend(str(tiny_model_dir), train_mode="full")
    await runtime.create_model("m", BASE, None)
    driver.watch_training_queue(lambda: 1)  # the gateway holds one more training request: keep the lane

    await train_step(runtime, reference, 1)  # borrowed before its forward_backward, trained on two lanes
    borrowed = driver.outcomes[-1]
    assert borrowed.action == "borrow" and borrowed.ok, borrowed.reason
    assert list(borrowed.phases) == ["drain", "free", "start", "state_transfer"]
    assert [lane.name for lane in hybrid.lanes] == ["core", f"lane-{LENT}"]
    assert lent_cell.state is CellState.LENT and runtime.inference.ready_cells() == [kept_cell]
    assert sorted(driver.status()["owners"].values()) == [f"engine:{KEPT}", f"lane:lane-{LENT}"]
    refused = await driver.loans.borrow(KEPT)  # would leave no rollout GPU: refused, nothing touched
    assert not refused.ok and "min_rollout_gpus" in refused.reason and kept_cell.state is CellState.READY
    await train_step(runtime, reference, 2)
    assert len(hybrid.lanes) == 2  # a training request still waits: no return between the steps

    snapshot = tmp_path / "snapshot"  # published during the loan: the push reaches the serving engine only
    if (written := await runtime.save_for_sampler("m", snapshot)) is not None:
        await written  # full fine-tuning: the files are written behind
    assert (snapshot / "config.json").is_file()
    await runtime.publish_sampler("m", SamplerTarget(BASE, snapshot))

    driver.watch_training_queue(lambda: 0)
    async with runtime.train_lock:  # the idle poller's move, at a step boundary
        decision = await driver.decide()
    assert decision is not None and (decision.action, decision.code) == ("return", "queue_drained")
    await driver.settle()
    returned = driver.outcomes[-1]
    assert returned.ok and list(returned.phases) == ["serving"], returned.reason
    assert [lane.name for lane in hybrid.lanes] == ["core"]
    assert ledger.loans[LENT].state is LoanState.SERVING and lent_cell.state is CellState.READY

    trained = await runtime.forward_backward(
        ForwardBackwardRequest("m", [prompt_datum()], "cross_entropy", {}, True)
    )
    expected = np.asarray(trained.logprobs[0], dtype=np.float64)
    for cell in (lent_cell, kept_cell):  # the returned engine got the trainer's (= the snapshot's) weights
        np.testing.assert_allclose(await engine_logprobs(cell.client), expected, atol=1e-4, rtol=0)
    base = TransformersBackend(str(tiny_model_dir), train_mode="full")
    untrained = base.forward_backward("m", [prompt_datum()], "cross_entropy", {}, forward_only=True)
    assert np.abs(np.asarray(untrained.logprobs[0]) - expected).max() > 1e-4  # the steps moved them
    sample = await runtime.sample(
        SamplerTarget(BASE, snapshot), PROMPT, SamplingParams(max_tokens=2), 1, LogprobSpec()
    )
    assert len(sample.sequences[0].tokens) == 2  # the snapshot is still the one served, not stale

    count = registry.get_sample_value
    assert count("miles_elastic_decisions_total", {"action": "borrow", "reason": "idle_engines"}) == 1
    assert count("miles_elastic_decisions_total", {"action": "return", "reason": "queue_drained"}) == 1
    assert count("miles_elastic_gpu_owner", {"owner": "engine"}) == 2
