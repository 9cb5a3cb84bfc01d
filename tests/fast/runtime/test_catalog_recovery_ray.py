"""Controller restart and epoch fencing in a catalog job (issue 13, items 9 and 11), on real Ray with
logical GPUs and a real redis-server.

- Restart: a first controller runs as its own Ray driver (a subprocess) with its books in Redis, starts an
  instance for each of two models, trains a tenant a step, and is SIGKILLed mid-life. One instance's
  trainer dies while no controller runs. A new controller on the same Redis re-adopts the live instance
  (same epoch, the tenant's adapter as it was: the same forward-only loss, and it trains on), releases the
  half-gone one (its engine and group removed, its tenant told the instance was lost), and Ray's free GPUs
  equal what the recovered books do not hold; at the end nothing is left.
- Fencing: a quarantined resident instance restarts under a new epoch; an operation admitted under the
  old epoch is refused (StaleEpoch) and never reaches the new instance, whose weights stay untouched.
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
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from miles.catalog.errors import HandleExpired, StaleEpoch
from miles.catalog.states import InstanceState
from miles.cluster.named import find_placement_group
from miles.state.redis_store import RedisStateStore
from miles.train.errors import TrainerUnavailableError
from miles.types import AdamParams, LoraSpec
from tests.fast.local_ray import init_local_ray
from tests.fast.runtime.catalog_first_life import build_recoverable_router, restart_models, train_batch
from tests.fast.runtime.catalog_stack import (
    alive_actor_count,
    build_router,
    free_resources,
    live_placement_groups,
    tiny_catalog_model,
)

pytestmark = pytest.mark.slow

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
    log = (workdir / "first-life.log").open("w")
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


async def test_a_restarted_controller_re_adopts_the_live_instance_and_releases_the_dead_one(
    ray_cluster: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    namespace, prefix = f"miles-test-{uuid.uuid4().hex[:8]}", f"catalog-restart-{uuid.uuid4().hex[:8]}"
    baseline_actors = alive_actor_count()
    spec = {
        "ray_address": ray_cluster,
        "namespace": namespace,
        "redis_url": redis_url,
        "prefix": prefix,
        "model_dir": str(tiny_model_dir),
        "log_dir": str(tmp_path / "logs"),
        "out": str(tmp_path / "first-life-done.json"),
    }
    first = await asyncio.to_thread(run_first_life, spec, tmp_path)
    (live_id, live_epoch), (dead_id, _) = first["instances"]["tiny-live"], first["instances"]["tiny-dead"]

    store = RedisStateStore(redis_url, key_prefix=prefix)
    router = build_recoverable_router(restart_models(), tiny_model_dir, tmp_path / "logs", store, namespace)
    dead_names = router.backend.names(dead_id)
    # the dead instance's trainer dies while no controller runs; its engine and group stay (half-gone)
    assert dead_names.kill("trainer-0")
    try:
        await router.controller.recover()
        await router.start()

        (adopted,) = router.controller.instances()
        assert (adopted.instance_id, adopted.spec.epoch) == (live_id, live_epoch)
        probe = await router.forward_backward("alice", train_batch(), "cross_entropy", {}, True)
        assert probe.metrics["loss:sum"] == pytest.approx(first["loss"], rel=1e-5)  # the same adapter
        await router.forward_backward("alice", train_batch(), "cross_entropy", {}, False)
        await router.optim_step("alice", AdamParams(learning_rate=1e-2))
        trained = await router.forward_backward("alice", train_batch(), "cross_entropy", {}, True)
        assert trained.metrics["loss:sum"] < first["loss"]  # it trains on from where it was

        with pytest.raises(HandleExpired, match="lost in a restart"):
            await router.forward_backward("bob", train_batch(), "cross_entropy", {}, True)
        assert find_placement_group(dead_names.group_name()) is None
        assert dead_names.lookup("engine-0") is None
        held = sum(i.spec.gpus for i in router.controller.instances())
        assert held == 2 and sum(router.controller.free_by_node().values()) == GPUS - held
        await settle(lambda: free_resources()["GPU"] == GPUS - held, "Ray's free GPUs = the books' free GPUs")
    finally:
        await router.close()
        await store.purge()
        await store.close()
    await settle(
        lambda: free_resources()["GPU"] == GPUS and not live_placement_groups(), "everything released"
    )
    await settle(lambda: alive_actor_count() == baseline_actors, "no actor left behind")


def loss(out) -> float:
    return float(out.metrics["loss:sum"])


async def test_an_operation_admitted_before_a_resident_restart_never_reaches_the_new_instance(
    ray_cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    router = build_router([tiny_catalog_model("tiny-res", "lora", resident=True)], tiny_model_dir, tmp_path)
    ctl = router.controller
    await router.start()
    try:
        await router.create_model("carol", "tiny-res", LoraSpec(rank=4))
        base = loss(await router.forward_backward("carol", train_batch(), "cross_entropy", {}, True))
        await router.forward_backward("carol", train_batch(), "cross_entropy", {}, False)
        await router.optim_step("carol", AdamParams(learning_rate=1e-2))
        old_runtime, old_epoch = ctl.handle_runtime("carol")  # a next step admitted under this epoch
        (old,) = ctl.instances()
        await ctl.quarantine(old.instance_id, "an operation ran past the execution timeout")

        (new,) = ctl.instances()
        assert new.resident and new.spec.epoch > old_epoch and new.state is InstanceState.READY
        with pytest.raises(HandleExpired, match="quarantined: an operation ran past"):
            await router.forward_backward("carol", train_batch(), "cross_entropy", {}, True)
        await router.create_model("carol", "tiny-res", LoraSpec(rank=4))  # again, on the new instance
        with pytest.raises(StaleEpoch, match=f"admitted under instance epoch {old_epoch}.*not applied"):
            ctl.check_epoch("carol", old_epoch)
        with pytest.raises(TrainerUnavailableError):  # nor can the old instance's runtime take it
            await old_runtime.optim_step("carol", AdamParams(learning_rate=1e-2))
        fresh = loss(await router.forward_backward("carol", train_batch(), "cross_entropy", {}, True))
        assert fresh == pytest.approx(base, rel=1e-6)  # the new instance's weights: untouched, the base
    finally:
        await router.close()
    await settle(
        lambda: free_resources()["GPU"] == GPUS and not live_placement_groups(), "everything released"
    )
