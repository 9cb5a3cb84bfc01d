"""RayRuntime's own rules, with fake controllers (no Ray): the LoRA rank cap, the one owner of a full
fine-tuning trainer, refusing stale full-weight snapshots (on disk or ephemeral), and holding a sampled
adapter against eviction.

The trainer fake records the commands it is sent; the inference fake is one engine that records adapter
loads and unloads and can hold a generate request open. The real push helpers (publish_adapter_dir,
unload_adapter) run on top of it; only the full-weight push, which needs a real weight-update group, is
replaced by a recorder.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from miles.errors import UnavailableError, UserError
from miles.rollout.controller import EngineLostError
from miles.rollout.load import SamplingLoad
from miles.runtime import ray_runtime
from miles.runtime.ray_runtime import RayRuntime
from miles.seam.requests import OptimStepRequest
from miles.seam.runtime import ModelCard, SamplerTarget
from miles.train import write_behind
from miles.train.commands import CreateAdapter, LoadState, Reset, StageHfWeights, TrainerCommand
from miles.types import AdamParams, LogprobSpec, LoraSpec, SamplingParams
from miles.weights.push import PushReport

BASE = "tiny/base"


class RecordingTrainer:
    def __init__(self) -> None:
        self.commands: list[TrainerCommand[Any]] = []

    async def run(self, command: TrainerCommand[Any]) -> Any:
        self.commands.append(command)

    def health_problem(self) -> str | None:
        return None

    async def stop(self) -> None:
        pass


class OneEngine:
    """The engine client: adapters by name, and generate answers one token (after `gate`, when set)."""

    base_url = "http://engine.test:30000"

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.sampled_with: list[str | None] = []
        self.gate: asyncio.Event | None = None
        self.unload_error: Exception | None = None
        self.generate_error: Exception | None = None

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        if name not in self.loaded:
            return  # a real engine refuses, and the push helpers ignore that refusal
        if self.unload_error is not None:
            raise self.unload_error
        del self.loaded[name]

    async def generate(self, *, lora_path: str | None, **_: Any) -> dict[str, Any]:
        self.sampled_with.append(lora_path)
        if self.gate is not None:
            await self.gate.wait()
        if self.generate_error is not None:
            raise self.generate_error
        meta = {"output_token_logprobs": [[-0.5, 7]], "finish_reason": {"type": "length"}}
        return {"output_ids": [7], "meta_info": meta}

    async def generate_stream(self, *, lora_path: str | None, **_: Any):
        """Cumulative chunks of 3 tokens, the first at once and the rest after `gate` (when set)."""
        self.sampled_with.append(lora_path)
        for n in (1, 2, 3):
            if n > 1 and self.gate is not None:
                await self.gate.wait()
            finish = {"type": "length"} if n == 3 else None
            meta = {"output_token_logprobs": [[-0.5, 7]] * n, "finish_reason": finish}
            yield {"output_ids": [7] * n, "meta_info": meta}


class OneEngineInference:
    def __init__(self, engine: OneEngine) -> None:
        self.engine = engine
        self.published_adapters: dict[str, str] = {}
        self.refresher: Any = None
        self.load = SamplingLoad()

    def set_weight_refresher(self, refresher: Any) -> None:
        self.refresher = refresher

    @asynccontextmanager
    async def weight_update(self, **_: Any):
        yield SimpleNamespace(clients=[self.engine], engines=[], version=1)

    def ready_engines(self) -> list[OneEngine]:
        return [self.engine]

    @property
    def cells(self) -> list[SimpleNamespace]:
        return self.ready_cells()

    def ready_cells(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name="engine cell 0", client=self.engine)]

    async def stop(self) -> None:
        pass


def card(train_mode: str, max_lora_rank: int | None = None) -> ModelCard:
    return ModelCard(
        name=BASE,
        max_context=128,
        trainable=True,
        sampleable=True,
        train_mode=train_mode,
        tokenizer_id=BASE,
        max_lora_rank=max_lora_rank,
    )


def make_runtime(train_mode: str, *, max_lora_rank: int | None = None, max_loaded_adapters: int = 16):
    trainer, engine = RecordingTrainer(), OneEngine()
    runtime = RayRuntime(
        card(train_mode, max_lora_rank),
        trainer,  # type: ignore[arg-type]
        OneEngineInference(engine),  # type: ignore[arg-type]
        max_loaded_adapters=max_loaded_adapters,
    )
    return runtime, trainer, engine


def snapshot(tmp_path: Path, name: str) -> SamplerTarget:
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return SamplerTarget(BASE, snapshot_path=path, snapshot_id=f"tinker://run/sampler_weights/{name}")


async def sample(runtime: RayRuntime, target: SamplerTarget) -> Any:
    return await runtime.sample(target, [1, 2, 3], SamplingParams(max_tokens=1), 1, LogprobSpec())


# ---- LoRA rank cap ----------------------------------------------------------------------------------


async def test_a_lora_rank_above_the_jobs_maximum_is_a_user_error_and_trains_nothing() -> None:
    runtime, trainer, _ = make_runtime("lora", max_lora_rank=8)
    with pytest.raises(UserError, match="LoRA rank 16 is above this job's maximum 8"):
        await runtime.create_model("too-big", BASE, LoraSpec(rank=16))
    assert trainer.commands == []
    with pytest.raises(UserError, match="create it first"):  # not registered either
        await runtime.optim_step(OptimStepRequest("too-big", None))  # type: ignore[arg-type]

    await runtime.create_model("at-the-cap", BASE, LoraSpec(rank=8))
    assert trainer.commands == [CreateAdapter("at-the-cap", LoraSpec(rank=8))]


# ---- full fine-tuning: one owner --------------------------------------------------------------------


async def test_full_fine_tuning_has_one_owner_until_it_is_released(tmp_path: Path) -> None:
    runtime, trainer, _ = make_runtime("full")
    await runtime.create_model("owner", BASE, None)
    await runtime.create_model("owner", BASE, None)  # the same model again: nothing new
    assert trainer.commands == [Reset("owner")]

    with pytest.raises(UserError, match="model owner owns the trainer"):
        await runtime.create_model("second", BASE, None)
    with pytest.raises(UserError, match="model owner owns the full fine-tuning trainer"):
        await runtime.load_state("second", tmp_path / "ckpt", with_optimizer=False)
    assert trainer.commands == [Reset("owner")]  # neither refusal reached the trainer

    await runtime.release_model("owner")
    await runtime.load_state("second", tmp_path / "ckpt", with_optimizer=True)  # create-via-load
    assert trainer.commands[1:] == [Reset("owner"), LoadState("second", tmp_path / "ckpt", True)]
    with pytest.raises(UserError, match="model second owns the trainer"):
        await runtime.create_model("owner", BASE, None)


# ---- full fine-tuning: stale snapshots --------------------------------------------------------------


@pytest.fixture
def recorded_pushes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    pushes: list[Any] = []

    async def push_full_weights(inference: Any, trainer: Any, config: Any) -> PushReport:
        pushes.append(trainer)
        return PushReport(version=len(pushes), buckets=0, bytes=0, engines=1)

    monkeypatch.setattr(ray_runtime, "push_full_weights", push_full_weights)
    return pushes


async def test_only_the_latest_full_weight_snapshot_can_be_sampled(tmp_path: Path, recorded_pushes) -> None:
    runtime, trainer, engine = make_runtime("full")
    await runtime.create_model("owner", BASE, None)
    first, second = snapshot(tmp_path, "first"), snapshot(tmp_path, "second")
    base = SamplerTarget(BASE)
    await sample(runtime, base)  # nothing trained is served yet: the base model samples

    timeline = await runtime.publish_sampler("owner", first)
    assert [(part.name, part.lane) for part in timeline] == [("prepare", "push")]  # the trace's push lane
    assert recorded_pushes == [trainer]
    await sample(runtime, first)
    with pytest.raises(UserError, match="serve a trained full-weight snapshot, not the base model"):
        await sample(runtime, base)

    await runtime.publish_sampler("owner", second)
    with pytest.raises(UserError, match="sampler_weights/first is stale"):
        await sample(runtime, first)
    await sample(runtime, second)
    assert engine.sampled_with == [None, None, None]  # full weights: never an adapter name

    # a respawned (or returned) engine gets the trainer's current weights: the snapshot's while the
    # trainer has not moved since the publish, newer ones that no saved snapshot holds after a step
    await runtime.inference.refresher(runtime.inference)
    await sample(runtime, second)
    await runtime.optim_step(OptimStepRequest("owner", AdamParams()))
    await runtime.inference.refresher(runtime.inference)
    assert len(recorded_pushes) == 4
    with pytest.raises(UserError, match="sampler_weights/second is stale"):
        await sample(runtime, second)


async def test_releasing_a_full_model_gives_the_engines_the_base_weights_back(
    tmp_path: Path, recorded_pushes
) -> None:
    runtime, trainer, _ = make_runtime("full")
    await runtime.create_model("owner", BASE, None)
    await runtime.release_model("owner")
    assert recorded_pushes == []  # the engines never left the base: nothing to push

    await runtime.create_model("owner", BASE, None)
    await runtime.publish_sampler("owner", snapshot(tmp_path, "trained"))
    await runtime.release_model("owner")
    assert len(recorded_pushes) == 2 and isinstance(trainer.commands[-1], Reset)  # reset, then pushed
    await runtime.create_model("next", BASE, None)
    await sample(runtime, SamplerTarget(BASE))  # the next tenant samples the base model again
    with pytest.raises(UserError, match="sampler_weights/trained is stale"):
        await sample(runtime, snapshot(tmp_path, "trained"))


# ---- full fine-tuning: ephemeral snapshots (unnamed saves, no files) ---------------------------------


def ephemeral(n: int) -> SamplerTarget:
    return SamplerTarget(BASE, snapshot_id=f"tinker://run/sampler_weights/ephemeral:{n}", ephemeral=True)


async def test_an_ephemeral_snapshot_is_served_like_a_file_snapshot_until_a_later_one(
    tmp_path: Path, recorded_pushes
) -> None:
    runtime, trainer, engine = make_runtime("full")
    await runtime.create_model("owner", BASE, None)
    await runtime.publish_sampler("owner", ephemeral(1))
    assert recorded_pushes == [trainer]  # pushed: the engines hold exactly its weights
    await sample(runtime, ephemeral(1))
    with pytest.raises(UserError, match="serve a trained full-weight snapshot, not the base model"):
        await sample(runtime, SamplerTarget(BASE))

    await runtime.optim_step(OptimStepRequest("owner", AdamParams()))
    await sample(runtime, ephemeral(1))  # the engines still hold its weights (nothing pushed since)
    await runtime.publish_sampler("owner", ephemeral(2))
    with pytest.raises(UserError, match=r"sampler_weights/ephemeral:1 is stale"):
        await sample(runtime, ephemeral(1))
    await sample(runtime, ephemeral(2))

    # a named (file) snapshot and an ephemeral one take turns by the same rule
    named = snapshot(tmp_path, "named")
    await runtime.publish_sampler("owner", named)
    with pytest.raises(UserError, match=r"sampler_weights/ephemeral:2 is stale"):
        await sample(runtime, ephemeral(2))
    await sample(runtime, named)
    await runtime.optim_step(OptimStepRequest("owner", AdamParams()))
    await runtime.inference.refresher(runtime.inference)  # a respawned engine: the trainer's newer weights
    with pytest.raises(UserError, match="sampler_weights/named is stale"):
        await sample(runtime, named)
    assert engine.sampled_with == [None] * 4  # full weights: never an adapter name


async def test_a_lora_runtime_refuses_an_ephemeral_snapshot(tmp_path: Path) -> None:
    runtime, _, engine = make_runtime("lora")
    with pytest.raises(UserError, match="needs a full fine-tuning job"):
        await runtime.publish_sampler("m", ephemeral(1))
    with pytest.raises(UserError, match="needs a full fine-tuning job"):
        await sample(runtime, ephemeral(1))
    assert engine.loaded == {} and engine.sampled_with == []  # never the base model in its place


def test_an_ephemeral_target_has_an_id_and_no_directory(tmp_path: Path) -> None:
    assert ephemeral(3).snapshot_key() == "tinker://run/sampler_weights/ephemeral:3"
    assert not ephemeral(3).is_base and SamplerTarget(BASE).is_base
    assert snapshot(tmp_path, "a").snapshot_key() == str((tmp_path / "a").resolve())
    with pytest.raises(ValueError, match="ephemeral"):
        SamplerTarget(BASE, ephemeral=True)
    with pytest.raises(ValueError, match="ephemeral"):
        SamplerTarget(BASE, snapshot_path=tmp_path, snapshot_id="x", ephemeral=True)


# ---- LoRA sampler adapters: held while sampled ------------------------------------------------------


async def test_an_adapter_being_sampled_is_not_evicted_until_its_sample_ends(tmp_path: Path) -> None:
    runtime, _, engine = make_runtime("lora", max_loaded_adapters=1)
    first, second, third = (snapshot(tmp_path, n) for n in ("first", "second", "third"))
    await runtime.publish_sampler("m", first)
    engine.gate = asyncio.Event()
    in_flight = asyncio.create_task(sample(runtime, first))
    while not engine.sampled_with:
        await asyncio.sleep(0)
    held = engine.sampled_with[0]
    assert held is not None and engine.loaded[held] == str(first.snapshot_path)

    await runtime.publish_sampler("m", second)  # over the limit, but `first` is being sampled
    assert held in engine.loaded

    engine.gate.set()
    await in_flight
    await runtime.publish_sampler("m", third)  # released: now the least recently used go
    assert list(engine.loaded.values()) == [str(third.snapshot_path)]


async def test_an_adapter_being_streamed_stays_held_until_the_stream_is_closed(tmp_path: Path) -> None:
    runtime, _, engine = make_runtime("lora", max_loaded_adapters=1)
    first, second, third = (snapshot(tmp_path, n) for n in ("first", "second", "third"))
    await runtime.publish_sampler("m", first)
    engine.gate = asyncio.Event()
    stream = runtime.stream_sample(first, [1, 2, 3], SamplingParams(max_tokens=3), 1)
    chunk = await anext(stream)
    assert chunk.tokens == [7] and chunk.stop_reason is None
    held = engine.sampled_with[0]
    await runtime.publish_sampler("m", second)  # over the limit, but `first` is being streamed
    assert held in engine.loaded
    await stream.aclose()  # the consumer went away before the end
    await runtime.publish_sampler("m", third)
    assert list(engine.loaded.values()) == [str(third.snapshot_path)]


async def test_a_failed_sample_releases_its_adapter(tmp_path: Path) -> None:
    runtime, _, engine = make_runtime("lora", max_loaded_adapters=1)
    first, second = snapshot(tmp_path, "first"), snapshot(tmp_path, "second")
    engine.generate_error = RuntimeError("engine went away mid-request")
    with pytest.raises(RuntimeError, match="went away"):
        await sample(runtime, first)
    engine.generate_error = None
    await runtime.publish_sampler("m", second)
    assert list(engine.loaded.values()) == [str(second.snapshot_path)]


async def test_an_adapter_held_for_a_sample_is_released_when_its_eviction_fails(tmp_path: Path) -> None:
    runtime, _, engine = make_runtime("lora", max_loaded_adapters=1)
    first, second, third = (snapshot(tmp_path, n) for n in ("first", "second", "third"))
    await runtime.publish_sampler("m", first)
    engine.unload_error = RuntimeError("engine refused the unload")
    with pytest.raises(RuntimeError, match="refused the unload"):
        await sample(runtime, second)  # loads second (held), then evicting first fails
    assert engine.sampled_with == [] and str(second.snapshot_path) in engine.loaded.values()

    engine.unload_error = None
    await runtime.publish_sampler("m", third)
    assert str(second.snapshot_path) not in engine.loaded.values()  # not pinned by the failed sample


# ---- engines that go away ---------------------------------------------------------------------------


class TwoEngineInference(OneEngineInference):
    """Two engine cells; `report_failure` takes a reported cell out of routing (as the controller does
    when the engine's probe fails too)."""

    def __init__(self, first: OneEngine, second: OneEngine) -> None:
        super().__init__(first)
        self._cells = [
            SimpleNamespace(name=f"engine cell {i}", client=engine, ready=True)
            for i, engine in enumerate((first, second))
        ]
        self.reported: list[tuple[str, str]] = []

    @property
    def cells(self) -> list[SimpleNamespace]:
        return self._cells

    def ready_cells(self) -> list[SimpleNamespace]:
        return [cell for cell in self._cells if cell.ready]

    async def report_failure(self, cell: SimpleNamespace, client: OneEngine, reason: str) -> None:
        assert cell.client is client
        self.reported.append((cell.name, reason))
        cell.ready = False


def two_engine_runtime() -> tuple[RayRuntime, TwoEngineInference]:
    inference = TwoEngineInference(OneEngine(), OneEngine())
    runtime = RayRuntime(card("lora"), RecordingTrainer(), inference)  # type: ignore[arg-type]
    return runtime, inference


async def test_a_sample_no_engine_received_goes_to_another_engine() -> None:
    runtime, inference = two_engine_runtime()
    first, second = (cell.client for cell in inference.cells)
    first.generate_error = httpx.ConnectError("All connection attempts failed")
    out = await sample(runtime, SamplerTarget(BASE))
    assert out.sequences[0].tokens == [7]
    assert len(first.sampled_with) == 1 and len(second.sampled_with) == 1
    assert [name for name, _ in inference.reported] == ["engine cell 0"]


async def test_a_sample_an_engine_had_started_fails_naming_the_engine_and_is_not_resent() -> None:
    runtime, inference = two_engine_runtime()
    first, second = (cell.client for cell in inference.cells)
    first.generate_error = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    with pytest.raises(EngineLostError, match=r"engine cell 0 \(.*\) went away while sampling") as caught:
        await sample(runtime, SamplerTarget(BASE))
    assert caught.value.category.value == "unavailable"
    assert second.sampled_with == []  # not resent to the other engine
    assert [name for name, _ in inference.reported] == ["engine cell 0"]
    assert (await sample(runtime, SamplerTarget(BASE))).sequences[0].tokens == [7]  # the next goes on


async def test_a_sample_that_finds_no_ready_engine_in_time_is_unavailable_not_a_server_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime, inference = two_engine_runtime()
    for cell in inference.cells:
        cell.ready = False  # a push in flight (or a respawn): nothing is routed to
    monkeypatch.setattr(ray_runtime, "ENGINE_WAIT_S", 0.3)
    with pytest.raises(UnavailableError, match="no weights-ready engine within 0 s") as caught:
        await sample(runtime, SamplerTarget(BASE))
    assert caught.value.category.value == "unavailable"  # 503, retried by clients; it was a bare 500


# ---- full fine-tuning: snapshots written behind -----------------------------------------------------


class StagingTrainer(RecordingTrainer):
    """Answers StageHfWeights at once, as the transformers backend does; the test writes the marker."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped_at: float | None = None
        self.problem: str | None = None

    async def run(self, command: TrainerCommand[Any]) -> Any:
        self.commands.append(command)
        return True if isinstance(command, StageHfWeights) else None

    def health_problem(self) -> str | None:
        return self.problem

    async def stop(self) -> None:
        self.stopped_at = time.monotonic()


def staging_runtime() -> tuple[RayRuntime, StagingTrainer]:
    trainer = StagingTrainer()
    runtime = RayRuntime(card("full"), trainer, OneEngineInference(OneEngine()))  # type: ignore[arg-type]
    return runtime, trainer


async def test_closing_lets_a_snapshot_being_written_finish_before_the_trainer_stops(tmp_path: Path) -> None:
    runtime, trainer = staging_runtime()
    await runtime.create_model("m", BASE, None)
    written = await runtime.save_for_sampler("m", tmp_path / "snap")
    assert written is not None and trainer.commands[-1] == StageHfWeights(tmp_path / "snap")
    waiting = asyncio.ensure_future(written)  # the gateway's commit waits on it
    loop = asyncio.get_running_loop()
    marked_at = time.monotonic() + 0.3
    loop.call_later(0.3, lambda: write_behind.written_marker(tmp_path / "snap").write_text("0.3"))
    await runtime.close()
    assert trainer.stopped_at is not None and trainer.stopped_at >= marked_at
    await waiting


async def test_a_trainer_that_dies_ends_the_wait_and_the_close_does_not_hang(tmp_path: Path) -> None:
    runtime, trainer = staging_runtime()
    await runtime.create_model("m", BASE, None)
    written = await runtime.save_for_sampler("m", tmp_path / "snap")
    assert written is not None
    waiting = asyncio.ensure_future(written)
    await asyncio.sleep(0.05)
    trainer.problem = "trainer cell 0 errored: rank 0 exited"
    with pytest.raises(write_behind.WriteBehindFailed, match=r"went away.*rank 0 exited"):
        await waiting
    await asyncio.wait_for(runtime.close(), 5)
