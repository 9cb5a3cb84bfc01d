"""Instance deaths in a catalog job (issue 13, item 12), on real Ray with the gateway and the tinker SDK:
one resident model and one dynamic model, 2 logical GPUs each.

- A dynamic instance whose trainer dies is released at the driver's next probe; its tenant's operations
  fail naming the death; healthz stays 200 and the job serves the rest (the resident model trains, the
  dynamic model starts again for a new tenant).
- An operation cut at the execution timeout (its trainer frozen) quarantines its instance: released, its
  tenant's next operation names the cause.
- A resident instance whose trainer dies makes healthz 503 naming it: the job ends, as with one model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
import tinker
from tinker import types

from miles.types import Datum
from tests.fast.local_ray import init_local_ray
from tests.fast.runtime.catalog_stack import (
    KEY,
    CatalogStack,
    build_router,
    kill_trainer,
    live_placement_groups,
    tiny_catalog_model,
    wait_for,
)

pytestmark = pytest.mark.slow

RESIDENT, DYNAMIC = "tiny-resident", "tiny-dynamic"
ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]
EXECUTION_TIMEOUT_S = 2.0  # the router's; the gateway's own stays at its default (nothing else is cut)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[CatalogStack]:
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=8, num_gpus=4)
    workdir = tmp_path_factory.mktemp("catalog")
    models = [tiny_catalog_model(RESIDENT, "lora", resident=True), tiny_catalog_model(DYNAMIC, "lora")]
    router = build_router(models, tiny_model_dir, workdir / "logs", execution_timeout_s=EXECUTION_TIMEOUT_S)
    served = CatalogStack(router, workdir).start()
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


def ref_batch() -> list[Datum]:
    return [
        Datum(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:]), "weights": np.ones(len(r) - 1)})
        for r in ROWS
    ]


def healthz(stack: CatalogStack) -> httpx.Response:
    return httpx.get(stack.url + "/api/v1/healthz", timeout=10, trust_env=False)


def probe(stack: CatalogStack) -> bool:
    """What the driver's probe loop (miles.serve.wait_for_shutdown) runs every interval."""
    return stack.call(stack.router.trainer.probe_cells(timeout_s=10))


def test_a_dynamic_instance_death_releases_it_and_fails_its_tenants_while_the_job_serves(stack) -> None:
    assert len(live_placement_groups()) == 1  # the resident instance, started at bring-up
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    tenant = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=1).result()
    tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert len(live_placement_groups()) == 2
    instance_id = kill_trainer(stack.router, DYNAMIC)

    assert probe(stack) is True  # no resident is dead: the job goes on
    assert len(live_placement_groups()) == 1 and instance_id not in stack.router.backend.running()
    with pytest.raises(tinker.RequestFailedError, match=rf"instance {instance_id} died"):
        tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert healthz(stack).status_code == 200

    resident = service.create_lora_training_client(base_model=RESIDENT, rank=4, seed=2).result()
    resident.forward_backward(sdk_batch(), "cross_entropy").result()
    again = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=3).result()
    again.forward_backward(sdk_batch(), "cross_entropy").result()  # a new instance, a new epoch
    assert len(live_placement_groups()) == 2


def test_an_operation_cut_at_the_execution_timeout_quarantines_its_instance(stack) -> None:
    """The trainer process is frozen (SIGSTOP): its actors would still be there, the operation never ends;
    the gateway's cut (here asyncio.wait_for at the router's execution timeout) quarantines the instance,
    which is released, and the tenant's next operation names the cause."""
    service = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    tenant = service.create_lora_training_client(base_model=DYNAMIC, rank=4, seed=4).result()
    (running,) = [r for r in stack.router.backend.running().values() if r.spec.model.name == DYNAMIC]
    pid = int(running.cells.trainer_cell.ranks_info[0]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        cut = asyncio.wait_for(
            stack.router.forward_backward(tenant.model_id, ref_batch(), "cross_entropy", {}, False),
            EXECUTION_TIMEOUT_S,
        )
        with pytest.raises(TimeoutError):
            stack.call(cut)
        instance_id = running.spec.instance_id
        wait_for(lambda: instance_id not in stack.router.backend.running(), 60, "the instance stopped")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    with pytest.raises(tinker.RequestFailedError, match=rf"{instance_id} was quarantined: forward_backward"):
        tenant.forward_backward(sdk_batch(), "cross_entropy").result()
    assert len(live_placement_groups()) == 1 and healthz(stack).status_code == 200


def test_a_resident_instance_death_turns_healthz_503_naming_it(stack) -> None:
    instance_id = kill_trainer(stack.router, RESIDENT)
    wait_for(lambda: probe(stack) is False, timeout_s=60, what="the probe to see the resident dead")
    answer = healthz(stack)
    assert answer.status_code == 503, answer.text
    assert answer.json()["status"] == "unavailable"
    assert f"resident instance {instance_id} of {RESIDENT} died" in answer.json()["error"]
