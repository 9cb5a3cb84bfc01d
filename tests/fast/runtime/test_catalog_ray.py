"""Catalog instances on real Ray (issue 13): a local cluster of one node with 4 logical GPUs, the real
RayInstanceBackend (STRICT_PACK groups, trainer and CPU engine cells), the CatalogController and the
CatalogRuntime router behind the gateway, the tinker SDK as the client.

The catalog is the tiny model under several names: `tiny-lora` (LoRA, 2 slots), `tiny-full` (full fine-
tuning), and `tiny-idle` / `tiny-full-idle` (LoRA / full with a 4 s idle timeout); each instance takes
2 GPUs, so the pool holds two instances.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import ray
import tinker
from tinker import types

from bench.tiny_catalog import build_router, tiny_catalog_model
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.types import AdamParams, Datum, LoraSpec
from tests.fast.local_ray import init_local_ray
from tests.fast.runtime.catalog_stack import (
    KEY,
    CatalogStack,
    alive_actor_count,
    engine_pids,
    free_resources,
    live_placement_groups,
    running_pids,
    unload,
    wait_for,
)

pytestmark = pytest.mark.slow

LORA, FULL, IDLE, FULL_IDLE = "tiny-lora", "tiny-full", "tiny-idle", "tiny-full-idle"
IDLE_TIMEOUT_S = 4.0
SAMPLING = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]
R = TypeVar("R")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[CatalogStack]:
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=8, num_gpus=4)
    baseline = {"resources": free_resources(), "actors": alive_actor_count()}
    workdir = tmp_path_factory.mktemp("catalog")
    models = [
        tiny_catalog_model(LORA, "lora"),
        tiny_catalog_model(FULL, "full"),
        tiny_catalog_model(IDLE, "lora", idle_s=IDLE_TIMEOUT_S),
        tiny_catalog_model(FULL_IDLE, "full", idle_s=IDLE_TIMEOUT_S),
    ]
    served = CatalogStack(build_router(models, tiny_model_dir, workdir / "logs"), workdir).start()
    served.baseline = baseline  # type: ignore[attr-defined]
    yield served
    served.stop()
    ray.shutdown()


def sdk_batch() -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)},
        )
        for row in ROWS
    ]


def loss(client: tinker.TrainingClient) -> float:
    out = client.forward_backward(sdk_batch(), "cross_entropy").result()
    return float(out.metrics["loss:sum"])


def trains(client: tinker.TrainingClient) -> tuple[float, float]:
    """(loss before, loss after) one Adam step: an instance that really trains moves the loss."""
    before = loss(client)
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return before, loss(client)


def free_gpus() -> float:
    return free_resources()["GPU"]


def create_at_once(url: str, base_model: str, clients: int) -> tuple[list[tinker.TrainingClient], list[str]]:
    """`clients` SDK clients (one ServiceClient each) create a full-mode training client of `base_model`
    at the same moment: (the created clients, the errors' texts)."""
    services = [tinker.ServiceClient(base_url=url, api_key=KEY) for _ in range(clients)]
    start = threading.Barrier(clients)
    created: list[tinker.TrainingClient] = []
    errors: list[str] = []

    def create(service: tinker.ServiceClient) -> None:
        start.wait()
        try:
            created.append(service.create_lora_training_client(base_model=base_model, rank=0).result())
        except Exception as exc:  # the SDK's error for a refused create
            errors.append(str(exc))

    threads = [threading.Thread(target=create, args=(service,)) for service in services]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return created, errors


def create_side_by_side(
    service: tinker.ServiceClient, ranks: dict[str, int]
) -> dict[str, tinker.TrainingClient]:
    """One training client (seed 7) of each model, their creations (instance starts) in flight together."""
    pending = {
        model: service.create_lora_training_client(base_model=model, rank=rank, seed=7)
        for model, rank in ranks.items()
    }
    return {model: future.result() for model, future in pending.items()}


def side_by_side(work: Callable[[str], R], models: list[str]) -> dict[str, R]:
    """`work(model)` for each model in its own thread, all at once; their results (or the first error)."""
    with ThreadPoolExecutor(len(models)) as pool:
        futures = {model: pool.submit(work, model) for model in models}
        return {model: future.result(timeout=300) for model, future in futures.items()}


def test_lora_tenants_start_lazily_share_expand_and_are_refused_when_the_pool_is_full(stack) -> None:
    assert live_placement_groups() == [] and free_gpus() == 4  # nothing starts before a tenant asks
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    a = service.create_lora_training_client(base_model=LORA, rank=4, seed=1).result()
    assert len(live_placement_groups()) == 1 and free_gpus() == 2
    b = service.create_lora_training_client(base_model=LORA, rank=4, seed=2).result()
    assert len(live_placement_groups()) == 1  # b shares a's instance (2 slots)
    for client in (a, b):
        before, after = trains(client)
        assert after < before
    # sampling: a's snapshot is served by a's instance, the base model by a running instance of it
    for sampler in (
        a.save_weights_and_get_sampling_client(name="a-1").result(),
        service.create_sampling_client(base_model=LORA).result(),
    ):
        out = sampler.sample(types.ModelInput.from_ints(ROWS[0]), 2, SAMPLING).result()
        assert len(out.sequences) == 2 and all(0 < len(seq.tokens) <= 4 for seq in out.sequences)
    # both slots taken: expansion to a second instance, which then holds d too
    c = service.create_lora_training_client(base_model=LORA, rank=4, seed=3).result()
    assert len(live_placement_groups()) == 2 and free_gpus() == 0
    d = service.create_lora_training_client(base_model=LORA, rank=4, seed=4).result()
    assert len(live_placement_groups()) == 2
    with pytest.raises(Exception, match=r"no capacity for model 'tiny-lora'.*free GPUs by node: [\d.]+: 0"):
        service.create_lora_training_client(base_model=LORA, rank=4, seed=5).result()
    with pytest.raises(Exception, match=r"no capacity for model 'tiny-full'"):
        service.create_lora_training_client(base_model=FULL, rank=0).result()

    unload(stack, a.model_id)
    before, after = trains(b)  # b goes on after its peer left
    assert after < before
    unload(stack, b.model_id)
    wait_for(lambda: free_gpus() == 2, what="the first instance's GPUs back")
    assert len(live_placement_groups()) == 1
    unload(stack, c.model_id)
    assert len(live_placement_groups()) == 1  # d still holds the second instance
    unload(stack, d.model_id)
    wait_for(lambda: free_resources() == stack.baseline["resources"], what="Ray's resources at baseline")
    assert live_placement_groups() == []


def test_full_tenants_own_an_instance_and_reuse_gpus_a_lora_instance_gave_back(stack) -> None:
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    clients = create_side_by_side(service, {LORA: 4, FULL: 0})  # the two instances start together
    lora, first = clients[LORA], clients[FULL]
    assert len(live_placement_groups()) == 2 and free_gpus() == 0
    trains(lora)
    unload(stack, lora.model_id)  # its GPUs are free again: a full instance of the other model takes them
    wait_for(lambda: len(live_placement_groups()) == 1 and free_gpus() == 2, what="the LoRA instance gone")

    before, after = trains(first)
    assert after < before
    # two SDK clients race for the last free instance's GPUs: the check and the claim are one step, so
    # exactly one wins (a new instance: full tenants never share) and the other is told why at once
    (second,), (refused,) = create_at_once(stack.url, FULL, clients=2)
    capacity_text = (  # the model, what was asked, what is free (one node, none free)
        r"no capacity for model 'tiny-full' \(full\): a new instance needs 2 GPU\(s\) on one node; "
        r"free GPUs by node: [\d.]+: 0\. Release a handle"
    )
    assert re.search(capacity_text, refused), refused
    assert len(live_placement_groups()) == 2 and free_gpus() == 0
    assert loss(second) == pytest.approx(before, rel=1e-5)  # its own instance: the base weights
    unload(stack, first.model_id)
    unload(stack, second.model_id)
    wait_for(lambda: free_resources() == stack.baseline["resources"], what="Ray's resources at baseline")


def test_idle_handles_expire_despite_heartbeats_and_recreation_starts_clean(stack) -> None:
    """For a LoRA and a full handle side by side (each in its own thread, so their instances start
    together and each handle is used as soon as it exists): the SDK's session heartbeats go on; no
    training or sampling operation for idle_timeout_s ends each handle, the last tenant's instance is
    released (Ray's resources back to the baseline), the handle's next operation says it expired, and a
    new handle (LoRA: the same seed) starts from the untrained state on a new instance: the same adapter,
    or the base weights."""
    ranks = {IDLE: 4, FULL_IDLE: 0}

    def create_and_train(model: str) -> tuple[tinker.TrainingClient, float]:
        service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
        first = service.create_lora_training_client(base_model=model, rank=ranks[model], seed=7).result()
        initial, trained = trains(first)
        assert trained < initial
        return first, initial

    firsts = side_by_side(create_and_train, list(ranks))
    wait_for(
        lambda: live_placement_groups() == [], IDLE_TIMEOUT_S + 30, "the idle handles' instances released"
    )
    wait_for(lambda: free_resources() == stack.baseline["resources"], what="Ray's resources at baseline")
    expired = r"\(tiny-[a-z-]+\) expired: it had no training or sampling operation for 4 s \(idle_timeout_s\)"
    for first, _ in firsts.values():
        with pytest.raises(tinker.RequestFailedError, match=expired):
            loss(first)

    def recreate(model: str) -> float:
        service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
        second = service.create_lora_training_client(base_model=model, rank=ranks[model], seed=7).result()
        recreated = loss(second)
        unload(stack, second.model_id)
        return recreated

    for model, recreated in side_by_side(recreate, list(ranks)).items():
        assert recreated == pytest.approx(firsts[model][1], rel=1e-6), model  # nothing of the first handle
    wait_for(lambda: free_resources() == stack.baseline["resources"], what="Ray's resources at baseline")


@pytest.mark.timeout(900)  # ten instance starts (five pairs) on a shared, loaded 2-core machine
def test_ten_create_train_release_cycles_leak_nothing(stack) -> None:
    """Ten cycles, each its own instance: created, trained a step, released. Two run at a time (a LoRA
    and a full one: the pool holds two instances), so the starts overlap; after all ten nothing is left."""
    router = stack.router
    seen_pids: list[int] = []
    batch = [
        Datum(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:]), "weights": np.ones(len(r) - 1)})
        for r in ROWS
    ]

    async def cycle(i: int, model: str, lora: LoraSpec | None) -> None:
        model_id = f"cycle-{i}"
        await router.create_model(model_id, model, lora)
        seen_pids.extend(await engine_pids(router))
        await router.forward_backward(ForwardBackwardRequest(model_id, batch, "cross_entropy", {}, False))
        await router.optim_step(OptimStepRequest(model_id, AdamParams(learning_rate=1e-2)))
        await router.release_model(model_id)

    async def pair(i: int) -> None:
        await asyncio.gather(cycle(2 * i, LORA, LoraSpec(rank=4, seed=i)), cycle(2 * i + 1, FULL, None))

    for i in range(5):
        stack.call(pair(i), timeout_s=240)
    assert len(set(seen_pids)) == 10  # each cycle started its own instance (one engine each)
    assert live_placement_groups() == []
    assert router.backend.running() == {}
    wait_for(lambda: running_pids(seen_pids) == [], what="every engine process gone")
    wait_for(lambda: free_resources() == stack.baseline["resources"], what="Ray's resources at baseline")
    wait_for(lambda: alive_actor_count() == stack.baseline["actors"], what="no instance actor alive")
