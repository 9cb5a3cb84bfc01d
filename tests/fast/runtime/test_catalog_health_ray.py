"""Resident instances and instance faults in a catalog job (issue 13, items 7, 10, 12, 13), on real Ray
with the gateway and the tinker SDK: a resident LoRA model, a resident full fine-tuning model and a dynamic
LoRA model, 2 logical GPUs each.

- Resident reset, numerically: after a tenant trained and left, a new tenant of the same resident
  instance sees exactly the base model's logprobs (fp32), its first optim_step gives exactly what it gave
  on the fresh instance (no Adam moments leaked), and sampling the base model gives the base logprobs.
- Sampling per instance: each instance's sampling slots are its own.
- A dynamic instance whose trainer dies is released at the driver's next probe; its tenant's operations
  fail naming the death; healthz stays 200 and the job serves the rest (the resident model trains, the
  dynamic model starts again for a new tenant).
- An operation the gateway cuts at its execution timeout (its trainer frozen) quarantines its instance:
  released, its tenant's next operation names the cause; a slow one inside the timeout does not.
- A resident instance whose trainer dies makes healthz 503 naming it: the job ends, as with one model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
import tinker
from tinker import types

from bench.tiny_catalog import build_router, tiny_catalog_model
from miles.gateway.settings import GatewaySettings
from miles.seam.runtime import SamplerTarget
from tests.fast.local_ray import init_local_ray
from tests.fast.runtime.catalog_stack import (
    KEY,
    CatalogStack,
    kill_trainer,
    live_placement_groups,
    unload,
    wait_for,
)

pytestmark = pytest.mark.slow

RESIDENT, RESIDENT_FULL, DYNAMIC = "tiny-resident", "tiny-resident-full", "tiny-dynamic"
ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]
PROBE = types.ModelInput.from_ints([3, 14, 15, 92, 65, 35, 89, 79])
# The gateway's execution timeout while the quarantine test runs (the rest of the module keeps the default:
# an instance's cold start takes longer)
EXECUTION_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[CatalogStack]:
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=10, num_gpus=6)
    workdir = tmp_path_factory.mktemp("catalog")
    models = [
        tiny_catalog_model(RESIDENT, "lora", resident=True),
        tiny_catalog_model(RESIDENT_FULL, "full", resident=True),
        tiny_catalog_model(DYNAMIC, "lora"),
    ]
    router = build_router(models, tiny_model_dir, workdir / "logs")
    served = CatalogStack(router, workdir, GatewaySettings(max_concurrent_samples=1)).start()
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


def forward_logprobs(client: tinker.TrainingClient) -> list[list[float]]:
    out = client.forward(sdk_batch(), "cross_entropy").result()
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def step(client: tinker.TrainingClient, learning_rate: float) -> None:
    client.forward_backward(sdk_batch(), "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=learning_rate)).result()


def base_logprobs(service: tinker.ServiceClient, base_model: str) -> list[float | None]:
    """What the engines give for the probe when sampling the base model (prompt logprobs, no sampling)."""
    return service.create_sampling_client(base_model=base_model).result().compute_logprobs(PROBE).result()


def healthz(stack: CatalogStack) -> httpx.Response:
    return httpx.get(stack.url + "/api/v1/healthz", timeout=10, trust_env=False)


def probe(stack: CatalogStack) -> bool:
    """What the driver's probe loop (miles.driver.serve.wait_for_shutdown) runs every interval."""
    return stack.call(stack.router.probe_trainers(timeout_s=10))


@pytest.mark.parametrize(("model", "rank"), [(RESIDENT, 4), (RESIDENT_FULL, 0)], ids=["lora", "full"])
def test_a_new_tenant_of_a_resident_instance_sees_nothing_of_the_previous_one(stack, model, rank) -> None:
    """The resident instance is fresh at first: a tenant's first forward gives the base model's logprobs
    and its first Adam step a reference result. A second tenant trains hard (adapter or weights move,
    Adam moments build up), publishes its weights to the engines, and leaves. A third tenant, on the same
    instance, gets exactly the fresh-instance numbers (fp32), and sampling the base model the base
    logprobs: no adapter, weight, moment or pushed weight of the second tenant survives."""
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    sampled_base = base_logprobs(service, model)
    fresh = service.create_lora_training_client(base_model=model, rank=rank, seed=11).result()
    base = forward_logprobs(fresh)
    step(fresh, 1e-2)
    after_one_step = forward_logprobs(fresh)
    assert after_one_step != base
    unload(stack, fresh.model_id)

    previous = service.create_lora_training_client(base_model=model, rank=rank, seed=12).result()
    for _ in range(3):
        step(previous, 5e-2)
    assert forward_logprobs(previous) != base
    published = previous.save_weights_and_get_sampling_client(name=f"{model}-previous").result()
    assert published.compute_logprobs(PROBE).result() != sampled_base  # the engines serve its weights
    unload(stack, previous.model_id)

    new = service.create_lora_training_client(base_model=model, rank=rank, seed=11).result()
    assert forward_logprobs(new) == base
    step(new, 1e-2)
    assert forward_logprobs(new) == after_one_step  # no Adam moments of `previous` in this step
    assert base_logprobs(service, model) == sampled_base
    unload(stack, new.model_id)


def test_each_instance_has_its_own_sampling_slots(stack) -> None:
    """max_concurrent_samples=1 per instance: a sample of one model waits for that model's instance
    only; another model's instance samples at once. The gateway asks the router which instance a target
    runs on; here the two residents' base models and a snapshot of each."""
    router = stack.router
    running = {r.spec.model.name: r.spec.instance_id for r in router.backend.running().values()}
    lane_of = lambda base_model: router.sampling_lane(SamplerTarget(base_model=base_model))  # noqa: E731
    assert lane_of(RESIDENT) == running[RESIDENT] != lane_of(RESIDENT_FULL) == running[RESIDENT_FULL]
    slots = stack.app.state.gateway.sampling.slots
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    lora_sampler = service.create_sampling_client(base_model=RESIDENT).result()
    full_sampler = service.create_sampling_client(base_model=RESIDENT_FULL).result()
    held = threading.Event()
    release = threading.Event()

    async def hold_the_lora_instance_slot() -> None:
        async with slots.lane(running[RESIDENT]):
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.05)

    holder = asyncio.run_coroutine_threadsafe(hold_the_lora_instance_slot(), stack.loop)
    assert held.wait(30)
    waiting = lora_sampler.compute_logprobs(PROBE)
    assert full_sampler.compute_logprobs(PROBE).result(timeout=60)  # its own instance, its own slot
    with pytest.raises(TimeoutError):
        waiting.result(timeout=1.0)  # behind the held slot of its instance
    release.set()
    holder.result(30)
    assert waiting.result(timeout=60)


def test_a_dynamic_instance_death_releases_it_and_fails_its_tenants_while_the_job_serves(stack) -> None:
    assert len(live_placement_groups()) == 2  # the resident instances, started at bring-up
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    tenant = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=1).result()
    tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert len(live_placement_groups()) == 3
    instance_id = kill_trainer(stack.router, DYNAMIC)

    assert probe(stack) is True  # no resident is dead: the job goes on
    assert len(live_placement_groups()) == 2 and instance_id not in stack.router.backend.running()
    with pytest.raises(tinker.RequestFailedError, match=rf"instance {instance_id} died"):
        tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert healthz(stack).status_code == 200

    resident = service.create_lora_training_client(base_model=RESIDENT, rank=4, seed=2).result()
    resident.forward_backward(sdk_batch(), "cross_entropy").result()
    again = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=3).result()
    again.forward_backward(sdk_batch(), "cross_entropy").result()  # a new instance, a new epoch
    assert len(live_placement_groups()) == 3


@contextlib.contextmanager
def execution_timeout(stack: CatalogStack, seconds: float) -> Iterator[None]:
    """The running gateway's execution timeout lowered for a while (its operations read it as they run)."""
    default = stack.settings.execution_timeout_s
    stack.settings.execution_timeout_s = seconds
    try:
        yield
    finally:
        stack.settings.execution_timeout_s = default


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP): its actors are still there, but it answers nothing until SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_an_operation_past_the_gateways_execution_timeout_quarantines_its_instance(stack) -> None:
    """The trainer process is frozen. Thawed inside the gateway's execution timeout, the slow operation
    completes and nothing is quarantined. Left frozen, the gateway cuts the operation and tells the router,
    which quarantines the instance: it is released, and the tenant's next operation names the cause."""
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    tenant = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=4).result()
    (running,) = [r for r in stack.router.backend.running().values() if r.spec.model.name == DYNAMIC]
    instance_id = running.spec.instance_id
    pid = int(running.cells.trainer_cell.ranks_info[0]["pid"])
    with execution_timeout(stack, EXECUTION_TIMEOUT_S):
        with frozen(pid):
            slow = tenant.forward_backward(sdk_batch(), "cross_entropy")
            threading.Event().wait(1.0)  # frozen for one second of the six
        slow.result()
        assert instance_id in stack.router.backend.running()  # slow, but inside the limit: no quarantine
        tenant.forward_backward(sdk_batch(), "cross_entropy").result()

        with frozen(pid):
            with pytest.raises(tinker.RequestFailedError, match=r"ForwardBackward ran longer than 6 s"):
                tenant.forward_backward(sdk_batch(), "cross_entropy").result()
            wait_for(lambda: instance_id not in stack.router.backend.running(), 60, "the instance stopped")
    cause = (
        rf"{instance_id} was quarantined: ForwardBackward on {tenant.model_id} ran past the execution timeout"
    )
    with pytest.raises(tinker.RequestFailedError, match=cause):
        tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert len(live_placement_groups()) == 2 and healthz(stack).status_code == 200  # the residents


def test_a_resident_instance_death_turns_healthz_503_naming_it(stack) -> None:
    instance_id = kill_trainer(stack.router, RESIDENT)
    wait_for(lambda: probe(stack) is False, timeout_s=60, what="the probe to see the resident dead")
    answer = healthz(stack)
    assert answer.status_code == 503, answer.text
    assert answer.json()["status"] == "unavailable"
    assert f"resident instance {instance_id} of {RESIDENT} died" in answer.json()["error"]
