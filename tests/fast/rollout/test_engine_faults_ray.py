"""Engine faults on the real stack (issue 19, "Faults"): real Ray (logical GPUs), two real CPU engine
processes in engine cells, a real LoRA trainer cell, the real InferenceController and RayRuntime.

- An engine process killed (SIGKILL) while it is generating: the caller gets EngineLostError naming the
  engine (no retry on another engine: see docs/reliability.md), the other engine's request completes, the
  dead engine leaves routing at once, is respawned, gets the published sampler adapters and only then is
  routed to, and serves what the other engine serves.
- A TCP reset in the middle of a bucket, injected by a relay between the driver and one engine: the push
  aborts (the bucket is not resent), the lock is released, no engine is routed to, the next push succeeds.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
import ray
from ray.util.placement_group import remove_placement_group

from miles.cluster.placement import create_gpu_placement_group
from miles.engines.config import EngineConfig
from miles.engines.errors import EngineRefused
from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.cell_state import CellState
from miles.rollout.controller import EngineLostError, InferenceController
from miles.rollout.engine_cell import EngineCell
from miles.rollout.health import HealthCheckConfig
from miles.rollout.sampling import snapshot_adapter_name
from miles.runtime.ray_runtime import RayRuntime
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, SamplerTarget
from miles.train.cell import TrainerCell
from miles.train.controller import TrainerController
from miles.types import AdamParams, Datum, LogprobSpec, LoraSpec, SamplingParams
from miles.weights.push import PushConfig, push_full_weights
from tests.fast.local_ray import init_local_ray
from tools.faults.reset_relay import ResetRelay

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BASE = "tiny/base"
PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11]
SMALL_BUCKETS = PushConfig(bucket_bytes=64 * 1024, group_timeout_s=60, cleanup_timeout_s=20)
HEALTH = HealthCheckConfig(interval_s=0.3, timeout_s=2, failure_threshold=3)
LONG = SamplingParams(max_tokens=1500, temperature=1.0, seed=11, stop_strings=(), stop_token_ids=())
SHORT = SamplingParams(max_tokens=4, temperature=1.0, seed=5)


def datum(tokens: list[int]) -> Datum:
    ids = np.asarray(tokens, dtype=np.int64)
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, dtype=np.float32)})


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    init_local_ray(tmp_path_factory.mktemp("ray"), num_cpus=8, num_gpus=8)
    yield
    ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(ray_session, tiny_model_dir: Path):
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    config = EngineConfig(model_path=str(tiny_model_dir), num_cpus=1, startup_timeout_s=120)
    controller = InferenceController([EngineCell(i, config, (pg, 1 + i)) for i in range(2)], health=HEALTH)
    cell = TrainerCell(0)
    await asyncio.gather(
        controller.start(), cell.start([(pg, 0)], model_path=str(tiny_model_dir), train_mode="lora")
    )
    card = ModelCard(
        name=BASE, max_context=2048, trainable=True, sampleable=True, train_mode="lora", tokenizer_id=BASE
    )
    trainer = TrainerController([cell])
    runtime = RayRuntime(card, trainer, controller, push=SMALL_BUCKETS)
    await runtime.publish_initial_weights()
    controller.start_health_checks()
    yield {"runtime": runtime, "controller": controller, "trainer": trainer}
    await runtime.close()
    remove_placement_group(pg)


async def engine_logprobs(client: SGLangApiClient, lora: str | None = None) -> np.ndarray:
    out = await client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
        lora_path=lora,
    )
    return np.asarray([p[0] for p in out["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


async def wait_until_generating(client: SGLangApiClient, timeout_s: float = 30.0) -> None:
    """SGLang (and the CPU engine) refuse to flush the cache while a request holds KV: a busy probe."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            await client.flush_cache()
        except EngineRefused:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{client.base_url} never started generating")


async def trained_adapter(runtime: RayRuntime, tmp_path: Path) -> SamplerTarget:
    await runtime.create_model("tenant-a", BASE, LoraSpec(rank=4, seed=3))
    batch = [datum([1, 2, 3, 4, 5, 6, 7, 8]), datum([40, 41, 42, 43, 44])]
    await runtime.forward_backward(ForwardBackwardRequest("tenant-a", batch, "cross_entropy", {}, False))
    await runtime.optim_step(OptimStepRequest("tenant-a", AdamParams(learning_rate=5e-2)))
    path = tmp_path / "tenant-a-sampler"
    await runtime.save_for_sampler("tenant-a", path)
    target = SamplerTarget(BASE, snapshot_path=path, snapshot_id="tinker://run/sampler_weights/a")
    await runtime.publish_sampler("tenant-a", target)
    return target


async def test_engine_killed_mid_sample_fails_naming_it_and_is_respawned_with_adapters_before_routing(
    stack, tmp_path: Path
) -> None:
    runtime, controller = stack["runtime"], stack["controller"]
    target = await trained_adapter(runtime, tmp_path)
    adapter = snapshot_adapter_name(str(target.snapshot_path.resolve()))
    victim, survivor = controller.cells
    victim_url, old_pid = victim.client.base_url, await victim.actor.pid.remote()

    # Record every routing decision (the cell and which of its processes) and when the respawned
    # engine's adapters were reloaded.
    routed: list[tuple[int, int, bool]] = []
    reloaded = asyncio.Event()
    pick, refresh = runtime._engine, controller._refresher

    async def recording_pick() -> Any:
        cell = await pick()
        routed.append((cell.index, cell.starts, reloaded.is_set()))
        return cell

    async def recording_refresh(ctrl: InferenceController) -> Any:
        assert victim.state is CellState.PENDING_WEIGHTS and victim not in ctrl.ready_cells()
        result = await refresh(ctrl)
        reloaded.set()
        return result

    runtime._engine = recording_pick  # type: ignore[method-assign]
    controller.set_weight_refresher(recording_refresh)

    async def long_sample() -> Any:
        return await runtime.sample(target, PROMPT, LONG, 1, LogprobSpec())

    first, second = asyncio.create_task(long_sample()), asyncio.create_task(long_sample())
    await asyncio.gather(wait_until_generating(victim.client), wait_until_generating(survivor.client))
    os.kill(old_pid, signal.SIGKILL)
    done_first, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    assert done_first.pop().exception() is not None  # the killed engine's request ends first
    # out of routing at once, not after 3 probe rounds (0.9 s here, 90 s with the defaults)
    assert victim.state is not CellState.READY and victim not in controller.ready_cells()
    results = await asyncio.gather(first, second, return_exceptions=True)

    lost = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(lost) == 1 and len(done) == 1, results
    assert isinstance(lost[0], EngineLostError), repr(lost[0])
    assert f"engine cell 0 ({victim_url}) went away while sampling" in str(lost[0])
    assert lost[0].category.value == "unavailable"  # the gateway answers 503 / a "server" future failure
    assert len(done[0].sequences[0].tokens) == LONG.max_tokens  # the other engine's request completed

    # Sampling goes on during the respawn; the respawned engine is routed to only after its reload.
    for _ in range(1200):
        if victim.starts == 2 and victim.state is CellState.READY:
            break
        outs = await asyncio.gather(*(runtime.sample(target, PROMPT, SHORT, 1, LogprobSpec()) for _ in "ab"))
        assert [len(out.sequences[0].tokens) for out in outs] == [SHORT.max_tokens] * 2
        await asyncio.sleep(0.02)
    assert victim.starts == 2 and victim.state is CellState.READY, (victim.state, victim.problem)
    for _ in range(4):
        await runtime.sample(target, PROMPT, SHORT, 1, LogprobSpec())
    await controller.health.wait_handled()
    assert [r for r in routed if r[:2] == (0, 2) and not r[2]] == [], routed
    assert (0, 2, True) in routed
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)

    # The respawned engine serves what the other one serves: the adapter's logprobs, and the same seeded
    # sample.
    on_survivor = await engine_logprobs(survivor.client, lora=adapter)
    np.testing.assert_allclose(await engine_logprobs(victim.client, lora=adapter), on_survivor, atol=1e-5)
    assert np.abs(on_survivor - await engine_logprobs(survivor.client)).max() > 1e-4  # the adapter applies
    runtime._engine = pick  # type: ignore[method-assign]
    controller.set_weight_refresher(refresh)
    seeded = [await runtime.sample(target, PROMPT, SHORT, 1, LogprobSpec()) for _ in range(2)]
    assert seeded[0].sequences[0].tokens == seeded[1].sequences[0].tokens  # one from each engine


@pytest.mark.parametrize("deliver", [True, False], ids=["request-delivered", "body-cut"])
async def test_tcp_reset_mid_bucket_aborts_the_push_and_the_next_push_succeeds(stack, deliver: bool) -> None:
    controller, trainer = stack["controller"], stack["trainer"]
    await controller.health.wait_handled()
    cell = controller.cells[1]
    direct = cell.client
    relay = ResetRelay(direct.base_url, cut=2, deliver=deliver)  # bucket 2 of the push
    cell.client = SGLangApiClient(relay_url := await relay.start(), weight_api=direct.weight_api)
    try:
        before = await engine_logprobs(direct)
        version = controller.weight_version
        with pytest.raises(httpx.TransportError) as caught:
            await push_full_weights(controller, trainer, SMALL_BUCKETS)
        assert relay_url in "".join(getattr(caught.value, "__notes__", []))
        assert relay.seen == 2, "update_weights_from_distributed must never be resent"
        assert not controller.update_in_progress, "the controller lock leaked"
        assert controller.ready_engines() == [], "an engine was routed to after an aborted push"
        assert [c.state for c in controller.cells] == [CellState.PENDING_WEIGHTS] * 2
        assert controller.health.running and controller.weight_version == version

        report = await push_full_weights(controller, trainer, SMALL_BUCKETS)
        assert report.version == version + 1 and report.buckets > 2
        assert relay.seen == 2 + report.buckets  # the next push went through the same relay
        assert len(controller.ready_engines()) == 2
        # the LoRA trainer's frozen base went out: both engines serve what they served before the push
        for client in controller.ready_engines():
            np.testing.assert_allclose(await engine_logprobs(client), before, atol=1e-5, rtol=0)
    finally:
        cell.client = direct
        await relay.close()


async def busy_cell(controller: InferenceController) -> Any:
    """The one engine cell with a request holding KV (flush refused), or None."""
    busy = []
    for cell in controller.ready_cells():
        try:
            await cell.client.flush_cache()
        except EngineRefused:
            busy.append(cell)
    assert len(busy) <= 1, busy
    return busy[0] if busy else None


async def test_engine_killed_mid_stream_ends_the_stream_with_the_error_naming_it(stack) -> None:
    """Chunks already passed on cannot be taken back: a stream whose engine dies fails, it never
    continues on another engine."""
    runtime, controller = stack["runtime"], stack["controller"]
    await controller.health.wait_handled()
    target = SamplerTarget(BASE)
    stream = runtime.stream_sample(target, PROMPT, LONG, 1)
    received = len((await anext(stream)).tokens)
    cell = None
    for _ in range(100):
        if (cell := await busy_cell(controller)) is not None:
            break
    assert cell is not None, "no engine was generating the stream"
    url, starts = cell.client.base_url, cell.starts
    os.kill(await cell.actor.pid.remote(), signal.SIGKILL)
    with pytest.raises(EngineLostError, match=rf"{cell.name} \({url}\) went away while sampling"):
        async for chunk in stream:
            received += len(chunk.tokens)
    assert 0 < received < LONG.max_tokens
    for _ in range(600):
        if cell.starts == starts + 1 and cell.state is CellState.READY:
            break
        await asyncio.sleep(0.05)
    assert cell.starts == starts + 1 and cell.state is CellState.READY
