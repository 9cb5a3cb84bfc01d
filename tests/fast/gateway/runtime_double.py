"""A test double of the Runtime (unit tests only): deterministic arithmetic, files for checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI

from miles.checkpoints.manager import CheckpointManager
from miles.errors import UserError
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.settings import GatewaySettings
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, Runtime, SamplerTarget
from miles.state import MemoryStateStore
from miles.types import (
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampledSequence,
    SampleOutput,
    SamplingParams,
)

BASE = "Qwen/Qwen3-8B"


def double_app(tmp_path: Path, runtime: Runtime, keys: dict[str, str], **settings: Any) -> FastAPI:
    """The gateway app over `runtime`: `keys` (key -> tenant), a memory store, checkpoints in tmp_path."""
    store = MemoryStateStore()
    checkpoints = CheckpointManager(tmp_path / "ckpt", store)
    return create_app(runtime, store, checkpoints, ApiKeys(keys), GatewaySettings(**settings))


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI, timeout: float = 10) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client of `app`; the app's queued operations are closed afterwards."""
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=timeout) as client:
            yield client
    finally:
        await app.state.gateway.ops.close()


class DoubleRuntime:
    def __init__(self, tokenizer_path: str | None = None) -> None:
        self.models: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.problem: str | None = None
        self.sample_delay_s = 0.0
        self.sample_empty = False
        self.samples_cancelled = 0
        self.tokenizer_path = tokenizer_path
        self.stream_events: list[tuple[str, int, int]] = []

    def model_cards(self) -> list[ModelCard]:
        return [
            ModelCard(
                name=BASE,
                max_context=512,
                trainable=True,
                sampleable=True,
                train_mode="lora",
                tokenizer_id=BASE,
                tokenizer_path=self.tokenizer_path,
            )
        ]

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        self.calls.append(("create_model", model_id))
        self.models[model_id] = {"step": 0, "bias": 0.0}

    def _model(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.models:
            raise RuntimeError(f"unknown model {model_id}")
        return self.models[model_id]

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        self.calls.append(("forward" if request.forward_only else "forward_backward", request.model_id))
        model = self._model(request.model_id)
        await asyncio.sleep(0.01)
        logprobs, losses = [], []
        for datum in request.data:
            if "target_tokens" not in datum.loss_fn_inputs:
                raise UserError("cross_entropy needs loss_fn_inputs['target_tokens']")
            lp = (-0.01 * datum.loss_fn_inputs["target_tokens"] - model["bias"]).astype(np.float32)
            weights = datum.loss_fn_inputs.get("weights", np.ones_like(lp))
            logprobs.append(lp)
            losses.append((-lp * weights).astype(np.float32))
        total = float(sum(x.sum() for x in losses))
        return ForwardBackwardOutput(logprobs=logprobs, elementwise_loss=losses, metrics={"loss:sum": total})

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]:
        self.calls.append(("optim_step", request.model_id))
        model = self._model(request.model_id)
        model["step"] += 1
        model["bias"] += request.adam.learning_rate
        return {"step:max": float(model["step"])}

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        self.calls.append(("save_state", model_id))
        (path / "state.json").write_text(json.dumps(self._model(model_id)))

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        self.calls.append(("load_state", model_id))
        self.models[model_id] = json.loads((path / "state.json").read_text())

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> None:
        self.calls.append(("publish_sampler", model_id))

    async def save_for_sampler(self, model_id: str, path: Path) -> None:
        self.calls.append(("save_for_sampler", model_id))
        (path / "adapter.json").write_text(json.dumps(self._model(model_id)))

    async def save_external(self, model_id: str, path: Path) -> None:
        """A stand-in HF directory: the model's state as its "weights" and a config in a subfolder."""
        self.calls.append(("save_external", model_id))
        (path / "model.safetensors").write_text(json.dumps(self._model(model_id)))
        (path / "tokenizer").mkdir()
        (path / "tokenizer" / "config.json").write_text('{"model_type": "double"}')

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        self.calls.append(("sample", target.snapshot_id or target.base_model))
        try:
            await asyncio.sleep(self.sample_delay_s)
        except asyncio.CancelledError:
            self.samples_cancelled += 1
            raise
        if self.sample_empty:
            return SampleOutput(sequences=[])
        n = params.max_tokens or 4
        seqs = [
            SampledSequence(
                tokens=self.sample_tokens(prompt, i, n),
                logprobs=[-0.5] * n,
                stop_reason="length",
                topk=[_top(t, logprobs.topk_sample) for t in range(n)] if logprobs.topk_sample else None,
            )
            for i in range(num_samples)
        ]
        return _with_prompt_side(SampleOutput(sequences=seqs), prompt, logprobs)

    @staticmethod
    def sample_tokens(prompt: list[int], index: int, n: int) -> list[int]:
        return [(prompt[-1] + index + k + 1) % 1000 + 20 for k in range(n)]

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        """One token per chunk, `sample_delay_s` apart; `stream_events` records each chunk as it is made."""
        self.calls.append(("stream_sample", target.snapshot_id or target.base_model))
        n = params.max_tokens or 4
        for k in range(n):
            for i in range(num_samples):
                await asyncio.sleep(self.sample_delay_s)
                token = self.sample_tokens(prompt, i, n)[k]
                self.stream_events.append(("chunk", i, k))
                yield SampleChunk(i, [token], [-0.5], "length" if k == n - 1 else None)
        self.stream_events.append(("end", -1, n))

    async def release_model(self, model_id: str) -> None:
        self.calls.append(("release_model", model_id))
        self.models.pop(model_id, None)

    def health_problem(self) -> str | None:
        return self.problem

    async def close(self) -> None:
        pass


def _top(position: int, k: int) -> list[tuple[int, float]]:
    """Deterministic stand-in top-k rows: ids position+1.., logprobs -1, -2, ..."""
    return [(position + 1 + j, -1.0 - j) for j in range(k)]


def _with_prompt_side(out: SampleOutput, prompt: list[int], spec: LogprobSpec) -> SampleOutput:
    first = 1 if spec.prompt_last_n is None else len(prompt) - spec.prompt_last_n
    if spec.prompt:
        out.prompt_logprobs = [None if p < first else -1.0 for p in range(len(prompt))]
    if spec.topk_prompt:
        out.topk_prompt = [None if p < first else _top(p, spec.topk_prompt) for p in range(len(prompt))]
    if spec.target_prompt is not None:
        # -0.01 * id at each named cell
        out.target_prompt = np.where(spec.target_prompt >= 0, -0.01 * spec.target_prompt, 0.0).astype(
            np.float32
        )
    if spec.alt_tokens_k:
        shape = (len(prompt) - 1, spec.alt_tokens_k)
        out.alt_tokens = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)
        out.alt_logprobs = np.full(shape, -2.0, dtype=np.float32)
    return out
