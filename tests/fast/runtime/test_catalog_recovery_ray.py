"""Controller restart and epoch fencing in a catalog job (issue 13, items 9 and 11), on real Ray with
logical GPUs and a real redis-server.

- Restart: a first controller runs as its own Ray driver (a subprocess) with its books in Redis: a
  resident model's instance with a tenant trained a step, and a dynamic model's instance with a tenant;
  it is SIGKILLed mid-life, and the dynamic instance's trainer dies while no controller runs. A new
  controller on the same Redis re-adopts the resident instance (same epoch, the tenant's adapter as it
  was: the same forward-only loss, and it trains on), releases the half-gone one (its engine and group
  removed, its tenant told the instance was lost), and Ray's free GPUs equal what the recovered books do
  not hold; at the end nothing is left.
- Fencing: the re-adopted resident, quarantined, restarts under a new epoch; an operation admitted under
  the old epoch is refused (StaleEpoch) and never reaches the new instance, whose weights stay the base.

One first life and one recovery serve both tests (instance starts are most of their time).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import ray

from bench.tiny_catalog import build_router
from miles.catalog.errors import HandleExpired, StaleEpoch
from miles.catalog.states import InstanceState
from miles.cluster.named import find_placement_group
from miles.runtime.catalog_runtime import CatalogRuntime
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.state.redis_store import RedisStateStore
from miles.train.errors import TrainerUnavailableError
from miles.types import AdamParams, LoraSpec
from tests.fast.local_ray import init_local_ray
from tests.fast.runtime.catalog_first_life import restart_models, train_batch
from tests.fast.runtime.catalog_stack import (
    alive_actor_count,
    free_resources,
    live_placement_groups,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

GPUS = 4
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=8, num_gpus=GPUS)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


async def settle(predicate, what: str, timeout_s: float = 30.0) -> None:
    """Ray's resource view and actor table settle within a report period; bounded."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def run_first_life(spec: dict, workdir: Path) -> dict:
    """Start the first controller, wait until it has trained, SIGKILL it; what it wrote."""
    spec_path = workdir / "first-life.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with (workdir / "first-life.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fast.runtime.catalog_first_life", str(spec_path)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 240
    try:
        while not Path(spec["out"]).is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the first controller ended early: {(workdir / 'first-life.log').read_text()}"
                )
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    return json.loads(Path(spec["out"]).read_text())


@pytest.fixture(scope="module")
def first_life(ray_cluster: str, redis_url: str, tiny_model_dir: Path, tmp_path_factory) -> dict:
    """The first controller's life, ended by SIGKILL: what it wrote, and where its books are."""
    workdir = tmp_path_factory.mktemp("first-life")
    spec = {
        "ray_address": ray_cluster,
        "namespace": f"miles-test-{uuid.uuid4().hex[:8]}",
        "redis_url": redis_url,
        "prefix": f"catalog-restart-{uuid.uuid4().hex[:8]}",
        "model_dir": str(tiny_model_dir),
        "log_dir": str(workdir / "logs"),
        "out": str(workdir / "first-life-done.json"),
    }
    return {**spec, **run_first_life(spec, workdir)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def recovered(first_life: dict, tiny_model_dir: Path) -> AsyncIterator[CatalogRuntime]:
    """A new controller and router on the first one's Redis books; the dynamic instance's trainer was
    killed before it recovers (its engine and group stay: half-gone). At the end: nothing is left."""
    store = RedisStateStore(first_life["redis_url"], key_prefix=first_life["prefix"])
    models = restart_models()
    router = build_router(
        models, tiny_model_dir, Path(first_life["log_dir"]), store=store, namespace=first_life["namespace"]
    )
    dead_id, _ = first_life["instances"]["tiny-dead"]
    assert router.backend.names(dead_id).kill("trainer-0")
    try:
        await router.controller.recover()
        await router.start()
        yield router
    finally:
        await router.close()
        await store.purge()
        await store.close()
    await settle(
        lambda: free_resources()["GPU"] == GPUS and not live_placement_groups(), "everything released"
    )
    await settle(lambda: alive_actor_count() == 0, "no actor left behind")


async def test_a_restarted_controller_re_adopts_the_live_instance_and_releases_the_dead_one(
    first_life: dict, recovered: CatalogRuntime
) -> None:
    router, ctl = recovered, recovered.controller
    live_id, live_epoch = first_life["instances"]["tiny-live"]
    (adopted,) = ctl.instances()  # the resident, not started again
    assert (adopted.instance_id, adopted.spec.epoch, adopted.resident) == (live_id, live_epoch, True)
    probe = await router.forward_backward(
        ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
    )
    assert loss(probe) == pytest.approx(first_life["loss"], rel=1e-5)  # the same adapter
    assert loss(probe) != pytest.approx(first_life["base_loss"], rel=1e-5)  # which is a trained one
    await router.forward_backward(ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, False))
    await router.optim_step(OptimStepRequest("alice", AdamParams(learning_rate=1e-2)))
    trained = await router.forward_backward(
        ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
    )
    assert loss(trained) < first_life["loss"]  # it trains on from where it was

    dead_id, _ = first_life["instances"]["tiny-dead"]
    dead = router.backend.names(dead_id)
    with pytest.raises(HandleExpired, match="lost in a restart"):
        await router.forward_backward(ForwardBackwardRequest("bob", train_batch(), "cross_entropy", {}, True))
    assert find_placement_group(dead.group_name()) is None and dead.lookup("engine-0") is None
    held = sum(i.spec.gpus for i in ctl.instances())
    assert held == 2 and sum(ctl.free_by_node().values()) == GPUS - held  # counted once
    await settle(lambda: free_resources()["GPU"] == GPUS - held, "Ray's free GPUs = the books' free GPUs")


async def test_an_operation_admitted_before_a_resident_restart_never_reaches_the_new_instance(
    first_life: dict, recovered: CatalogRuntime
) -> None:
    router, ctl = recovered, recovered.controller
    old_runtime, old_epoch = ctl.handle_runtime("alice")  # a next step admitted under this epoch
    (old,) = ctl.instances()
    await ctl.quarantine(old.instance_id, "an operation ran past the execution timeout")

    (new,) = ctl.instances()
    assert new.resident and new.spec.epoch > old_epoch and new.state is InstanceState.READY
    with pytest.raises(HandleExpired, match="quarantined: an operation ran past"):
        await router.forward_backward(
            ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
        )
    await router.create_model("alice", "tiny-live", LoraSpec(rank=4))  # again, on the new instance
    with pytest.raises(StaleEpoch, match=f"admitted under instance epoch {old_epoch}.*not applied"):
        ctl.check_epoch("alice", old_epoch)
    with pytest.raises(TrainerUnavailableError):  # nor can the old instance's runtime take it
        await old_runtime.optim_step(OptimStepRequest("alice", AdamParams(learning_rate=1e-2)))
    fresh = await router.forward_backward(
        ForwardBackwardRequest("alice", train_batch(), "cross_entropy", {}, True)
    )
    assert loss(fresh) == pytest.approx(first_life["base_loss"], rel=1e-5)  # the new instance: the base


def loss(out) -> float:
    return float(out.metrics["loss:sum"])
