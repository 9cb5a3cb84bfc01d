"""RayRuntime: the gateway's Runtime on the job's Ray cluster (trainer cells + engine cells + the push).

One resident base model. Training commands (miles.train.commands) go to the TrainerController, which runs
them on every rank of the first alive trainer cell; sampling
goes to a weights-ready engine, round-robin; every weight change on the engines runs inside the
InferenceController's update bracket (miles.weights.push).

LoRA: each tenant model is a named adapter on the trainer's frozen base; `save_for_sampler` exports an
immutable PEFT snapshot and loads it on every engine under a name derived from the snapshot, selected per
request with `lora_path`. Full fine-tuning: one model at a time owns the trainer (others are refused);
`publish_sampler` pushes the trainer's weights to the engines, which then serve that snapshot only —
sampling an older full-weight snapshot is refused as stale (engines hold one weight set). A named save
writes the HF weights snapshot first; an unnamed one is ephemeral (no files: the push is all there is),
identified by its snapshot id where a named one is by its directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from miles.engines.sglang_client import SGLangApiClient
from miles.errors import UnavailableError, UserError
from miles.rollout.cell_state import CellState
from miles.rollout.controller import EngineLostError, InferenceController
from miles.rollout.sampling import sample_on_engine, snapshot_adapter_name, stream_on_engine
from miles.runtime.adapters import AdapterResidency
from miles.runtime.colocation import ColocatedGpus, ColocationGate, ColocationPlan, GpuPhase
from miles.seam.capabilities import ElasticTraining, ServingDegradation
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, SamplerTarget, SupervisedRuntime
from miles.train import write_behind
from miles.train.coalescer import DEFAULT_WINDOW_S, ForwardBackwardCoalescer, OptimStepMany
from miles.train.commands import (
    CreateAdapter,
    ExportAdapter,
    ExportMergedHfWeights,
    ForwardBackward,
    LoadState,
    OptimStep,
    RemoveAdapter,
    Reset,
    SaveState,
    StageHfWeights,
    TrainerCommand,
)
from miles.train.controller import TrainerController
from miles.types import (
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
    TimedPart,
)
from miles.weights.ipc_push import EngineStep, push_over_ipc
from miles.weights.push import (
    PushConfig,
    publish_adapter_dir,
    push_full_weights,
    push_timeline,
    reload_published_adapters,
    unload_adapter,
)

log = logging.getLogger(__name__)
R = TypeVar("R")

ENGINE_WAIT_S = 120.0  # sampling waits this long for a weights-ready engine (a push is in flight)
# a snapshot written behind that has no marker after this long is given up (a 70B's 140 GB at ~1 GB/s: 140 s)
WRITE_BEHIND_TIMEOUT_S = 1800.0
CLOSE_WRITES_S = 120.0  # a closing runtime waits this long for them


class RayRuntime(SupervisedRuntime, ElasticTraining, ServingDegradation):
    def __init__(
        self,
        card: ModelCard,
        trainer: TrainerController,
        inference: InferenceController,
        *,
        push: PushConfig | None = None,
        max_loaded_adapters: int = 16,
        lora_batch_window_s: float = DEFAULT_WINDOW_S,
        colocation: ColocationPlan | None = None,
    ) -> None:
        self.card = card
        self.trainer = trainer
        self.inference = inference
        self.push = push or PushConfig()
        self._models: set[str] = set()
        self._full_owner: str | None = None  # full fine-tuning: the model that owns the trainer
        self._writing: set[Path] = set()  # sampler snapshots its trainer is writing behind (write_behind.py)
        self._served_snapshot: str | None = None  # full: snapshot id the engines serve
        self._serving_trained_weights = False  # full: engines hold weights other than the base model's
        self._train_lock = asyncio.Lock()  # one model's command at a time on the shared trainer
        self._trainer_moved = False  # full: the trainer stepped (or reset, loaded) since the last publish
        self.elastic: Any = None  # miles.elastic.driver.ElasticDriver when elastic.enabled
        self._training_queue: Callable[[], int] | None = None  # the gateway's count of queued operations
        self._adapter_lock = asyncio.Lock()
        self._residency = AdapterResidency(max_loaded_adapters)
        self._round_robin = itertools.count()
        # LoRA: several models' forward_backward requests in one pass over the base (miles.train.coalescer);
        # full fine-tuning has one model, nothing to merge
        self.coalescer = ForwardBackwardCoalescer(
            self._train,
            window_s=0.0 if self.full else lora_batch_window_s,
            models=lambda: len(self._models),
        )
        inference.set_weight_refresher(self._refresh_engine_weights)
        # Colocated (docs/colocation.md): training and sampling take turns on the GPUs through one gate
        self.gate: ColocationGate | None = None
        if colocation is not None:
            push = self._push_colocated if self.full else None
            switch = ColocatedGpus(colocation, inference, trainer, push)
            self.gate = ColocationGate(switch, sampling_wait_s=ENGINE_WAIT_S)
            inference.set_respawn_gate(lambda: self._holding(GpuPhase.SAMPLING))

    @property
    def full(self) -> bool:
        return self.card.train_mode == "full"

    # ---- bring-up ---------------------------------------------------------------------------------

    async def publish_initial_weights(self) -> None:
        """Engines start PENDING_WEIGHTS: full mode pushes the trainer's base weights, LoRA mode has the
        base on disk already and just opens the engines (an empty adapter set)."""
        await self._refresh_engine_weights(self.inference)

    async def _refresh_engine_weights(self, inference: InferenceController) -> Any:
        if not self.full:
            return await reload_published_adapters(inference)
        # A respawned engine gets the trainer's weights as they are now (no optimizer step mid-push), which
        # are not a saved snapshot: until the next save_weights_for_sampler, snapshots are refused as stale.
        async with self._train_lock:
            report = await self._push_full(inference)
            # unmoved since the publish, the trainer's weights are the snapshot's (an engine back from a
            # loan, or respawned, between a save and its samples): the snapshot stays servable
            if self._served_snapshot is not None and self._trainer_moved:
                log.warning(
                    "engines refreshed with the current trainer weights; %s is stale now",
                    self._served_snapshot,
                )
                self._served_snapshot = None
                self._serving_trained_weights = True
            return report

    async def _push_full(self, inference: InferenceController, then: EngineStep | None = None) -> Any:
        """The trainer's weights to every serving engine: over IPC when colocated, else the NCCL/gloo push."""
        if self.gate is not None:
            return await push_over_ipc(inference, self.trainer, self.push, then=then)
        return await push_full_weights(inference, self.trainer, self.push)

    async def _push_colocated(self, then: EngineStep | None) -> None:
        """The switch to sampling's push (the gate holds the trainer idle): afterwards the engines serve
        the trainer's current weights, which are the served snapshot's only if it has not moved since."""
        await self._push_full(self.inference, then)
        if self._trainer_moved and self._served_snapshot is not None:
            self._served_snapshot = None
            self._serving_trained_weights = True

    def _holding(self, side: GpuPhase) -> contextlib.AbstractAsyncContextManager[None]:
        """The GPUs on `side` for the body (colocated), or nothing to hold (split roles)."""
        return self.gate.hold(side) if self.gate is not None else contextlib.nullcontext()

    # ---- catalogue --------------------------------------------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        return [self.card]

    def _check_base(self, base_model: str) -> None:
        if base_model != self.card.name:
            raise UserError(f"unknown base model {base_model!r}; this job serves {self.card.name!r}")

    def _require(self, model_id: str) -> None:
        if model_id not in self._models:
            raise UserError(f"model {model_id} is not loaded on this runtime; create it first")

    # ---- training ---------------------------------------------------------------------------------

    async def _train(self, command: TrainerCommand[R]) -> R:
        async with self._holding(GpuPhase.TRAINING), self._train_lock:
            return await self._run(command)

    async def _run(self, command: TrainerCommand[R]) -> R:
        """The caller holds the training lock. With elastic training the lanes see what they must."""
        if isinstance(command, (OptimStep, OptimStepMany, Reset, LoadState)):
            self._trainer_moved = True
        if self.elastic is not None:
            return await self.elastic.run(command)
        return await self.trainer.run(command)

    # ---- elastic hybrid training (docs/elastic.md) ------------------------------------------------

    @property
    def train_lock(self) -> asyncio.Lock:
        return self._train_lock

    def attach_elastic(self, driver: Any) -> None:
        self.elastic = driver
        if self._training_queue is not None:
            driver.watch_training_queue(self._training_queue)

    def watch_training_queue(self, waiting: Callable[[], int]) -> None:
        """The gateway's count of queued training operations (miles.seam.runtime.watch_training_queue)."""
        self._training_queue = waiting
        if self.elastic is not None:
            self.elastic.watch_training_queue(waiting)

    def elastic_status(self) -> dict[str, Any] | None:
        return self.elastic.status() if self.elastic is not None else None

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        self._check_base(base_model)
        if model_id in self._models:
            return
        if self.full:
            if self._full_owner is not None:
                raise UserError(
                    f"this job does full fine-tuning and model {self._full_owner} owns the trainer; "
                    "release it (finish its session) before creating another"
                )
            self._full_owner = model_id
            await self._train(Reset(model_id))
        else:
            if lora is None:
                raise UserError("this job trains LoRA adapters; pass a lora_config with a rank")
            limit = self.card.max_lora_rank
            if limit is not None and lora.rank > limit:
                raise UserError(
                    f"LoRA rank {lora.rank} is above this job's maximum {limit} (model.lora_rank, the "
                    f"rank the engines are started for); use a rank <= {limit}"
                )
            await self._train(CreateAdapter(model_id, lora))
        self._models.add(model_id)

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        self._require(request.model_id)
        return await self.coalescer.submit(ForwardBackward.of(request))

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]:
        self._require(request.model_id)
        return await self.coalescer.submit(OptimStep.of(request))  # other models' steps may join it

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        self._require(model_id)
        await self._train(SaveState(model_id, Path(path), with_optimizer))

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        if model_id not in self._models:
            # create-via-load: the saved state names its own adapter spec / full weights
            if self.full:
                if self._full_owner not in (None, model_id):
                    raise UserError(f"model {self._full_owner} owns the full fine-tuning trainer")
                self._full_owner = model_id
            self._models.add(model_id)
        await self._train(LoadState(model_id, Path(path), with_optimizer))

    def adopt_models(self, model_ids: list[str]) -> None:
        """A restarted driver took these cells over with these handles (their adapters, or the full
        owner's weights, and optimizer state are on the trainer already). Full mode: the engines serve the
        owner's current weights (the adoption pushed them), so its release pushes the base back."""
        self._models.update(model_ids)
        if self.full and model_ids:
            self._full_owner = model_ids[0]
            self._serving_trained_weights = True

    async def release_model(self, model_id: str) -> None:
        if model_id not in self._models:
            return
        self._models.discard(model_id)
        self.coalescer.forget(model_id)
        if self.full:
            self._full_owner = None
            await self._reset_full_trainer(model_id)
        else:
            await self._train(RemoveAdapter(model_id))

    async def _reset_full_trainer(self, model_id: str) -> None:
        """The trainer back to the base weights; engines serving the leaving tenant's weights get the base
        back too, so the next tenant samples the base model (and never sees the last tenant's weights)."""
        if self.gate is not None:  # the next switch to sampling pushes the base weights
            await self._train(Reset(model_id))
            self._served_snapshot = None
            self._serving_trained_weights = False
            return
        async with self._train_lock:
            await self._run(Reset(model_id))
            if not self._serving_trained_weights:
                return
            await push_full_weights(self.inference, self.trainer, self.push)
            self._served_snapshot = None
            self._serving_trained_weights = False

    # ---- sampler snapshots ------------------------------------------------------------------------

    async def save_for_sampler(self, model_id: str, path: Path) -> Awaitable[None] | None:
        """Full fine-tuning writes the files behind (miles.train.write_behind) where the backend can: the
        host copy is made before this returns, and the awaitable it returns completes when the files are
        whole. LoRA adapters (small, and the engines load them from the files) are written before."""
        self._require(model_id)
        if not self.full:
            await self._train(ExportAdapter(model_id, Path(path)))
            return None
        if not await self._train(StageHfWeights(Path(path))):
            return None
        self._writing.add(Path(path))
        return self._written(Path(path))

    async def _written(self, path: Path) -> None:
        try:
            seconds = await write_behind.wait_written(path, self.health_problem, WRITE_BEHIND_TIMEOUT_S)
        finally:
            self._writing.discard(path)
        log.debug("the files in %s were written behind in %.2f s", path, seconds)

    async def _let_writes_finish(self, timeout_s: float = CLOSE_WRITES_S) -> None:
        """Before the trainer stops (a catalog release, the job's end): its snapshots being written behind
        get `timeout_s` to finish, or they are lost with its process."""
        deadline = time.monotonic() + timeout_s
        while self._writing and time.monotonic() < deadline and self.health_problem() is None:
            await asyncio.sleep(0.1)
        if self._writing:
            log.error(
                "stopping the trainer with %d sampler snapshot(s) still being written", len(self._writing)
            )

    async def save_external(self, model_id: str, path: Path) -> None:
        self._require(model_id)
        await self._train(ExportMergedHfWeights(model_id, Path(path)))

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> list[TimedPart]:
        snapshot = target.snapshot_key()  # the directory, or an ephemeral snapshot's id (no files)
        if snapshot is None:
            raise UserError("publish_sampler needs a committed snapshot directory")
        if target.ephemeral and not self.full:
            raise UserError("an ephemeral sampler snapshot (no files) needs a full fine-tuning job")
        started = time.time()
        if not self.full:
            async with self._holding(GpuPhase.SAMPLING):  # colocated: adapters load on resumed engines
                name = await self._load_adapter(snapshot)
            return [TimedPart("load_adapter", "push", started, time.time() - started, {"adapter": name})]
        if self.gate is not None:
            # the switch to sampling pushes the trainer's weights, which no training command can move
            # before it returns (training waits for the other side): they are the snapshot's
            async with self.gate.hold(GpuPhase.SAMPLING):
                self._trainer_moved = False
                self._served_snapshot = snapshot
                self._serving_trained_weights = True
            return [TimedPart("switch_to_sampling", "push", started, time.time() - started)]
        async with self._train_lock:  # the engines get exactly the weights the snapshot holds
            pushed_at = time.time()
            report = await push_full_weights(self.inference, self.trainer, self.push)
            self._trainer_moved = False
        self._served_snapshot = snapshot
        self._serving_trained_weights = True
        return push_timeline(report, pushed_at)

    async def _load_adapter(self, snapshot: str, *, hold: bool = False) -> str:
        """Load an adapter snapshot on every engine once (respawned engines reload all published ones).

        `hold`: the caller samples from it next; it is marked in use before anything else can evict it
        (the caller releases it)."""
        name = snapshot_adapter_name(snapshot)
        async with self._adapter_lock:  # concurrent first samples of one snapshot load it once
            if self.inference.published_adapters.get(name) != snapshot:
                await publish_adapter_dir(
                    self.inference,
                    lora_name=name,
                    path=snapshot,
                    wait_for_engines_s=self.push.wait_for_engines_s,
                )
            if hold:
                self._residency.acquire(name)
            else:
                self._residency.touch(name)
            try:
                for victim in self._residency.victims():
                    log.info("unloading sampler adapter %s (least recently used)", victim)
                    await unload_adapter(self.inference, lora_name=victim)
            except BaseException:
                if hold:  # the caller never gets the name, so it cannot release it
                    self._residency.release(name)
                raise
        return name

    # ---- sampling ---------------------------------------------------------------------------------

    async def _engine(self) -> Any:
        """A weights-ready engine cell, round-robin."""
        deadline = time.monotonic() + ENGINE_WAIT_S
        while True:
            ready = self.inference.ready_cells()
            if ready:
                return ready[next(self._round_robin) % len(ready)]
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"no weights-ready engine within {ENGINE_WAIT_S:.0f} s (weights are being pushed, or "
                    "engines respawned); retry in a few seconds"
                )
            await asyncio.sleep(0.1)

    async def _engine_gone(self, cell: Any, client: SGLangApiClient, exc: httpx.TransportError) -> None:
        """Take a dead engine out of routing at once (the controller probes it first)."""
        what = f"{type(exc).__name__} while sampling: {exc}"
        await self.inference.report_failure(cell, client, what)

    def _lost(self, cell: Any, client: SGLangApiClient, exc: httpx.TransportError) -> EngineLostError:
        return EngineLostError(
            f"{cell.name} ({client.base_url}) went away while sampling ({type(exc).__name__}: {exc}); "
            "the request is not sent to another engine (it may be what ended this one, and a seeded "
            "sample would come from another engine); send it again: the engine is being respawned"
        )

    async def _lora_path(self, target: SamplerTarget) -> str | None:
        snapshot = target.snapshot_key()  # the directory, or an ephemeral snapshot's id (no files)
        if snapshot is None:
            if self.full and self._serving_trained_weights:
                raise UserError(
                    "the engines serve a trained full-weight snapshot, not the base model's weights; "
                    "sample from the latest sampler path instead"
                )
            return None
        if target.ephemeral and not self.full:
            raise UserError("an ephemeral sampler snapshot (no files) needs a full fine-tuning job")
        if not self.full:
            return await self._load_adapter(snapshot, hold=True)  # held until the sample is done
        if snapshot != self._served_snapshot:
            raise UserError(
                f"sampler snapshot {target.snapshot_id or snapshot} is stale: the engines serve "
                "the latest full-weight snapshot only; call save_weights_for_sampler again"
            )
        return None

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        self._check_base(target.base_model)
        async with self._holding(GpuPhase.SAMPLING):
            return await self._sample(target, prompt, params, num_samples, logprobs)

    async def _sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        lora_path = await self._lora_path(target)
        try:
            # A request no engine received (connection refused) goes to another engine; one that an
            # engine had started fails with EngineLostError (docs/reliability.md, "Faults (runtime)").
            for _ in range(len(self.inference.cells) + 1):
                cell = await self._engine()
                client = cell.client
                try:
                    with self.inference.load.track(cell.name):  # sampling in flight per engine (elastic)
                        return await sample_on_engine(
                            client,
                            prompt,
                            params,
                            num_samples=num_samples,
                            logprobs=logprobs,
                            lora_path=lora_path,
                        )
                except httpx.TransportError as exc:
                    await self._engine_gone(cell, client, exc)
                    if not isinstance(exc, httpx.ConnectError):
                        raise self._lost(cell, client, exc) from exc
                    last = self._lost(cell, client, exc)
            raise last
        finally:
            if lora_path is not None:
                self._residency.release(lora_path)

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        self._check_base(target.base_model)
        async with self._holding(GpuPhase.SAMPLING):
            async for chunk in self._stream(target, prompt, params, num_samples):
                yield chunk

    async def _stream(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        lora_path = await self._lora_path(target)
        try:
            cell = await self._engine()
            client = cell.client
            try:
                with self.inference.load.track(cell.name):
                    async for chunk in stream_on_engine(
                        client, prompt, params, num_samples=num_samples, lora_path=lora_path
                    ):
                        yield chunk
            except httpx.TransportError as exc:  # chunks already passed on cannot be taken back: no retry
                await self._engine_gone(cell, client, exc)
                raise self._lost(cell, client, exc) from exc
        finally:
            if lora_path is not None:
                self._residency.release(lora_path)

    # ---- health and shutdown ----------------------------------------------------------------------

    def health_problem(self) -> str | None:
        return self.trainer.health_problem()

    def degradation(self) -> str | None:
        """Engines out of service (failed, respawning) and unsettled colocated GPUs, for healthz."""
        failed = [cell for cell in self.inference.cells if cell.state is CellState.FAILED]
        problems = [f"{cell.name}: {cell.problem or 'failed'}" for cell in failed]
        if self.gate is not None and (unsettled := self.gate.problem()) is not None:
            problems.append(unsettled)
        return "; ".join(problems) or None

    async def probe_trainers(self, timeout_s: float) -> bool:
        return await self.trainer.probe_cells(timeout_s=timeout_s)

    def trainer_liveness(self) -> list[tuple[int, bool]]:
        return [(cell.index, cell.is_alive) for cell in self.trainer.cells]

    async def close(self) -> None:
        await self._let_writes_finish()
        if self.elastic is not None:
            await self.elastic.stop()
        await asyncio.gather(self.inference.stop(), self.trainer.stop(), return_exceptions=True)
