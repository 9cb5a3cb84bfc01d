"""A 2-rank data-parallel LoRA trainer cell on real Ray takes merged commands: concurrent tenants go through
ForwardBackwardCoalescer -> TrainerController -> both ranks (each runs its share of every tenant's datums in
one pass), and each tenant's outputs, and its adapter after a step, equal the tenant run alone in process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from miles.errors import UserError
from miles.train.cell import TrainerCell
from miles.train.coalescer import ForwardBackwardCoalescer
from miles.train.commands import CreateAdapter, ForwardBackward, OptimStep
from miles.train.controller import TrainerController
from miles.types import AdamParams, LoraSpec
from tests.fast.local_ray import init_local_ray
from tests.fast.train.test_multi_tenant import TENANTS, _assert_same_output, _backend, _requests

ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=2, num_gpus=2)
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2)
    ray.get(pg.ready(), timeout=120)
    cell = TrainerCell(0, user_error_grace_s=20, collective_timeout_s=60)
    asyncio.run(cell.start([(pg, 0), (pg, 1)], model_path=str(tiny_model_dir), train_mode="lora"))
    yield TrainerController([cell])
    asyncio.run(cell.stop())
    remove_placement_group(pg)
    ray.shutdown()


async def test_merged_commands_on_two_ranks_equal_each_tenant_alone(controller, tiny_model_dir: Path) -> None:
    alone = _backend(tiny_model_dir)
    for index, (key, rank, _, _) in enumerate(TENANTS):
        await controller.run(CreateAdapter(key, LoraSpec(rank=rank, alpha=16.0, seed=10 + index)))
    coalescer = ForwardBackwardCoalescer(controller.run, window_s=600.0, models=lambda: len(TENANTS))
    requests = _requests()
    bad = requests[2]
    requests[2] = ForwardBackward(bad.key, bad.data, bad.loss_fn, {"no_such_key": 1.0})
    results = await asyncio.wait_for(
        asyncio.gather(*(coalescer.submit(r) for r in requests), return_exceptions=True), timeout=120
    )
    assert coalescer.stats.commands == 1
    assert isinstance(results[2], UserError) and "no_such_key" in str(results[2])
    good = [0, 1, 3]
    for index in good:
        _assert_same_output(results[index], requests[index].run(alone))
    # the step sums both ranks' gradients: the adapters then answer as the ones trained alone
    for index in good:
        key = requests[index].key
        want = alone.optim_step(key, ADAM)["grad_norm:mean"]
        assert (await controller.run(OptimStep(key, ADAM)))["grad_norm:mean"] == pytest.approx(want, rel=1e-5)
    after = _requests(seed=50)
    coalescer = ForwardBackwardCoalescer(controller.run, window_s=600.0, models=lambda: len(good))
    got = await asyncio.wait_for(asyncio.gather(*(coalescer.submit(after[i]) for i in good)), timeout=120)
    for result, index in zip(got, good, strict=True):
        _assert_same_output(result, after[index].run(alone))
