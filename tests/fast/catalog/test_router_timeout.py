"""CatalogRuntime hearing the gateway's timeout signals, over the real controller and the in-memory backend:
a training operation's (`operation_timed_out`, by handle) and a sample's (`sampling_lane_timed_out`, by
the lane it was admitted to: the instance). The instance is refused to its handles at once (an operation
queued right behind the cut one never reaches it), then quarantined (stopped, every tenant's handle ended
naming the cause); a signal for a handle or lane that holds no instance changes nothing."""

from __future__ import annotations

import asyncio
import re

import pytest

from miles.catalog.controller import CatalogController
from miles.catalog.errors import HandleExpired
from miles.contract.catalog import PoolNode
from miles.errors import UnavailableError
from miles.runtime.catalog_runtime import CatalogRuntime
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.types import AdamParams, LoraSpec
from tests.fast.catalog.memory_backend import MemoryBackend, catalog_model

CAUSE = "ForwardBackward on m-1 ran past the execution timeout (6 s)"


async def _router() -> tuple[CatalogRuntime, MemoryBackend]:
    backend = MemoryBackend([PoolNode("10.0.0.9", 4, is_head=True)])
    controller = CatalogController([catalog_model("tiny-a")], backend)
    router = CatalogRuntime(controller, backend, {})  # type: ignore[arg-type]
    for model_id in ("m-1", "m-2"):  # two LoRA tenants sharing one instance
        await controller.acquire(model_id, "tiny-a", "lora", LoraSpec(rank=4))
    return router, backend


async def _until(condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_a_timed_out_operation_cuts_its_instance_at_once_then_quarantines_it() -> None:
    router, backend = await _router()
    (instance_id,) = backend.live
    router.operation_timed_out("m-1", "ForwardBackward", CAUSE)
    # no await in between: the next operation (of either tenant) is refused before the quarantine ran
    for model_id in ("m-1", "m-2"):
        with pytest.raises(
            UnavailableError, match=re.escape(f"instance {instance_id} is being quarantined: {CAUSE}")
        ):
            await router.optim_step(OptimStepRequest(model_id, AdamParams(learning_rate=1e-3)))
    await _until(lambda: backend.stopped == [instance_id], "the quarantined instance stopped")
    for model_id in ("m-1", "m-2"):
        with pytest.raises(
            HandleExpired, match=re.escape(f"its instance {instance_id} was quarantined: {CAUSE}")
        ):
            await router.optim_step(OptimStepRequest(model_id, AdamParams(learning_rate=1e-3)))
    await router.close()


async def test_a_signal_for_a_handle_without_an_instance_changes_nothing() -> None:
    router, backend = await _router()
    router.operation_timed_out("never-created", "CreateModel", "CreateModel on never-created ran past it")
    await asyncio.sleep(0.05)
    assert backend.stopped == [] and len(backend.live) == 1
    assert [i.state.value for i in router.controller.instances()] == ["ready"]
    await router.close()


SAMPLE_CAUSE = "Sample ran past the execution timeout (6 s)"


async def test_a_sample_cut_on_an_instances_lane_cuts_that_instance_then_quarantines_it() -> None:
    router, backend = await _router()
    (instance_id,) = backend.live
    other = await router.controller.acquire("m-3", "tiny-a", "full", None)  # a second instance: spared
    router.sampling_lane_timed_out(instance_id, SAMPLE_CAUSE)
    router.sampling_lane_timed_out(instance_id, SAMPLE_CAUSE)  # a second hung sample: one quarantine
    for model_id in ("m-1", "m-2"):
        with pytest.raises(
            UnavailableError, match=re.escape(f"instance {instance_id} is being quarantined: {SAMPLE_CAUSE}")
        ):
            await router.forward_backward(ForwardBackwardRequest(model_id, [], "cross_entropy", {}, False))
    await _until(lambda: backend.stopped == [instance_id], "the quarantined instance stopped")
    with pytest.raises(HandleExpired, match=re.escape(f"{instance_id} was quarantined: {SAMPLE_CAUSE}")):
        await router.optim_step(OptimStepRequest("m-1", AdamParams(learning_rate=1e-3)))
    assert list(backend.live) == [other.instance_id]
    await router.close()


async def test_a_sample_cut_on_a_lane_that_is_no_instance_changes_nothing() -> None:
    router, backend = await _router()
    router.sampling_lane_timed_out("", SAMPLE_CAUSE)  # ONE_LANE: the target had no instance to run on
    router.sampling_lane_timed_out("tiny-a-gone", SAMPLE_CAUSE)  # released before the cut was heard
    await asyncio.sleep(0.05)
    assert backend.stopped == [] and len(backend.live) == 1
    await router.close()
