"""A real in-process Runtime for tests and the tiny-cpu stack: one TransformersBackend, one CPU engine.

Training commands (miles.train.commands) go to an InProcessTrainer: the backend runs them on its
dedicated thread, one at a time (adapters share the base model), so the event loop never blocks. Sampling goes
through SGLangApiClient to a CPU engine subprocess; a sampler snapshot is a PEFT adapter directory that
is loaded into the engine once (`load_lora_adapter`) and then selected per request with `lora_path`.
LoRA only: full fine-tuning needs weight pushes into the engine, which the Ray runtime does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from miles.engines.config import EngineConfig
from miles.engines.process import EngineProcess
from miles.errors import UserError
from miles.rollout.sampling import sample_on_engine, snapshot_adapter_name, stream_on_engine
from miles.runtime.model_config import model_arch
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, SamplerTarget
from miles.train.coalescer import DEFAULT_WINDOW_S, ForwardBackwardCoalescer
from miles.train.commands import (
    CreateAdapter,
    ExportAdapter,
    ExportMergedHfWeights,
    ForwardBackward,
    LoadState,
    OptimStep,
    RemoveAdapter,
    SaveState,
)
from miles.train.in_process import InProcessTrainer
from miles.types import (
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
    TimedPart,
)

log = logging.getLogger(__name__)
# how long close() waits for a trainer command in flight (a checkpoint being written) to end
TRAINER_CLOSE_TIMEOUT_S = 60.0


def _log_engine_exit(returncode: int) -> None:
    # health_problem() reports it; the job's watchdog (or the test) decides what to do
    log.error("the CPU engine exited with %s; this runtime can no longer sample", returncode)


class LocalRuntime:
    def __init__(
        self,
        model_path: Path,
        *,
        model_name: str,
        engine: EngineProcess,
        backend: Any,
        tokenizer_id: str | None = None,
        lora_batch_window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self.model_path = Path(model_path).resolve()
        self.model_name = model_name
        # The SDK loads the tokenizer with AutoTokenizer(tokenizer_id): the local directory works offline.
        self.tokenizer_id = tokenizer_id or str(self.model_path)
        self._arch = model_arch(self.model_path)  # read once: model_cards() does no I/O
        self._engine = engine
        self._client = engine.client()
        self._trainer = InProcessTrainer(backend)
        # several models' forward_backward requests in one pass over the base (miles.train.coalescer)
        self.coalescer = ForwardBackwardCoalescer(
            self._trainer.run, window_s=lora_batch_window_s, models=lambda: len(self._models)
        )
        self._adapter_lock = asyncio.Lock()
        self._loaded_adapters: dict[str, str] = {}  # snapshot dir -> engine adapter name
        self._models: set[str] = set()

    @classmethod
    async def start(
        cls,
        model_path: Path,
        *,
        model_name: str,
        engine_log: Path | None = None,
        torch_threads: int = 1,
        tokenizer_id: str | None = None,
        lora_batch_window_s: float = DEFAULT_WINDOW_S,
    ) -> LocalRuntime:
        import torch

        from miles.train.backends.transformers_backend import TransformersBackend

        torch.set_num_threads(torch_threads)
        # the same launch as a job's engines: engine_env(), a per-process key, the parent-death signal
        config = EngineConfig(model_path=str(model_path), kind="cpu", api_key=secrets.token_hex(16))
        engine = EngineProcess(config, host="127.0.0.1", on_exit=_log_engine_exit)
        engine.start(str(engine_log) if engine_log else None)
        try:
            backend = await asyncio.to_thread(TransformersBackend, str(model_path), train_mode="lora")
            await engine.wait_healthy(timeout_s=180.0)
        except BaseException:
            engine.stop()
            raise
        return cls(
            model_path,
            model_name=model_name,
            engine=engine,
            backend=backend,
            tokenizer_id=tokenizer_id,
            lora_batch_window_s=lora_batch_window_s,
        )

    @property
    def engine(self) -> EngineProcess:
        return self._engine

    def model_cards(self) -> list[ModelCard]:
        return [
            ModelCard(
                name=self.model_name,
                max_context=int(self._trainer.backend.max_context),
                trainable=True,
                sampleable=True,
                train_mode="lora",
                tokenizer_id=self.tokenizer_id,
                tokenizer_path=str(self.model_path),
                arch=self._arch,
            )
        ]

    def _check_base(self, base_model: str) -> None:
        if base_model != self.model_name:
            raise UserError(f"unknown base model {base_model!r}; this runtime serves {self.model_name!r}")

    def _require(self, model_id: str) -> None:
        if model_id not in self._models:
            raise UserError(f"model {model_id} is not loaded on this runtime; create it first")

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        self._check_base(base_model)
        if lora is None:
            raise UserError("this runtime trains LoRA adapters only; pass a lora_config (rank)")
        if model_id in self._models:
            return
        await self._trainer.run(CreateAdapter(model_id, lora))
        self._models.add(model_id)

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        self._require(request.model_id)
        return await self.coalescer.submit(ForwardBackward.of(request))

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]:
        self._require(request.model_id)
        return await self.coalescer.submit(OptimStep.of(request))  # other models' steps may join it

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        self._require(model_id)
        await self._trainer.run(SaveState(model_id, Path(path), with_optimizer))

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        self._require(model_id)
        await self._trainer.run(LoadState(model_id, Path(path), with_optimizer))

    async def save_external(self, model_id: str, path: Path) -> None:
        self._require(model_id)
        await self._trainer.run(ExportMergedHfWeights(model_id, Path(path)))

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> list[TimedPart]:
        started = time.time()
        name = await self._adapter_name(target)  # load it on the engine now, not on the first sample
        return [TimedPart("load_adapter", "push", started, time.time() - started, {"adapter": name})]

    async def save_for_sampler(self, model_id: str, path: Path) -> None:
        self._require(model_id)
        await self._trainer.run(ExportAdapter(model_id, Path(path)))

    async def _adapter_name(self, target: SamplerTarget) -> str | None:
        if target.ephemeral:  # the gateway makes these for full fine-tuning only, which this runtime lacks
            raise UserError("an ephemeral sampler snapshot (no files) needs a full fine-tuning runtime")
        if target.snapshot_path is None:
            return None
        key = str(Path(target.snapshot_path).resolve())
        async with self._adapter_lock:
            name = self._loaded_adapters.get(key)
            if name is None:
                # Snapshots are immutable, so one load per snapshot path serves every later request.
                name = snapshot_adapter_name(key)
                await self._client.load_lora_adapter(name, key)
                self._loaded_adapters[key] = name
        return name

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        self._check_base(target.base_model)
        adapter = await self._adapter_name(target)
        return await sample_on_engine(
            self._client,
            prompt,
            params,
            num_samples=num_samples,
            logprobs=logprobs,
            lora_path=adapter,
        )

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        self._check_base(target.base_model)
        adapter = await self._adapter_name(target)
        async for chunk in stream_on_engine(
            self._client, prompt, params, num_samples=num_samples, lora_path=adapter
        ):
            yield chunk

    async def release_model(self, model_id: str) -> None:
        if model_id in self._models:
            await self._trainer.run(RemoveAdapter(model_id))
            self._models.discard(model_id)
            self.coalescer.forget(model_id)

    def health_problem(self) -> str | None:
        return None if self._engine.alive() else "the CPU engine process is not running"

    async def close(self) -> None:
        self._trainer.close()
        if not await self._trainer.wait_closed(TRAINER_CLOSE_TIMEOUT_S):
            log.warning(
                "a trainer command still runs %.0f s after close; leaving it", TRAINER_CLOSE_TIMEOUT_S
            )
        self._engine.stop()
