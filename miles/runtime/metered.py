"""MeteredRuntime: any Runtime, with its training and sampling measured (metrics + the event log).

The composition sites wrap the runtime they built (`miles.driver.bringup` for jobs, the local server)
before handing it to the gateway, so every runtime is measured the same way and the gateway itself stays
unaware. Everything not measured here passes straight through to the wrapped runtime, each method by
name: the wrapper offers every optional capability (miles.seam.capabilities) and answers for one the
wrapped runtime lacks as the seam's helpers do for a runtime without it, so wrapping hides nothing and
adds nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from miles.contract import events
from miles.errors import MilesError
from miles.observability.metrics import JobMetrics, job_metrics
from miles.seam import runtime as seam
from miles.seam.capabilities import (
    ElasticTraining,
    ModelCatalog,
    OperationTimeouts,
    SamplingLanes,
    ServingDegradation,
)
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ModelCard, Runtime, SamplerTarget
from miles.types import (
    Datum,
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
    TimedPart,
)


def batch_tokens(data: Sequence[Datum]) -> int:
    return sum(len(datum.model_input) for datum in data)


def mean_token_loss(out: ForwardBackwardOutput, data: Sequence[Datum]) -> float | None:
    """loss:sum over the batch's total weight (the loss the demo and the cookbook print)."""
    total = out.metrics.get("loss:sum")
    if total is None:
        return None
    weight = sum(float(d.loss_fn_inputs["weights"].sum()) for d in data if "weights" in d.loss_fn_inputs)
    return float(total) / (weight if weight > 0 else max(batch_tokens(data), 1))


def is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, MilesError) and exc.category.reported == "user"


class MeteredRuntime(
    Runtime, OperationTimeouts, SamplingLanes, ElasticTraining, ModelCatalog, ServingDegradation
):
    def __init__(self, inner: Runtime, metrics: JobMetrics | None = None) -> None:
        self.inner = inner
        self.metrics = metrics or job_metrics()

    @contextlib.contextmanager
    def _command(self, model_id: str, command: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except Exception as exc:
            if is_refusal(exc):
                self.metrics.train_refusals.labels(model_id, command).inc()
            raise
        finally:
            self.metrics.train_seconds.labels(model_id, command).observe(time.monotonic() - started)

    # ---- measured -------------------------------------------------------------------------------------

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        model_id, data = request.model_id, request.data
        command = "forward" if request.forward_only else "forward_backward"
        started = time.monotonic()
        with self._command(model_id, command):
            out = await self.inner.forward_backward(request)
        seconds = time.monotonic() - started
        tokens = batch_tokens(data)
        loss = mean_token_loss(out, data)
        self.metrics.train_tokens.labels(model_id).inc(tokens)
        self.metrics.train_tokens_per_second.labels(model_id).set(tokens / max(seconds, 1e-9))
        if loss is not None:
            self.metrics.train_loss.labels(model_id).set(loss)
        events.record(
            "train", model=model_id, command=command, tokens=tokens, seconds=round(seconds, 4), loss=loss
        )
        return out

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]:
        started = time.monotonic()
        with self._command(request.model_id, "optim_step"):
            result = await self.inner.optim_step(request)
        self.metrics.optim_steps.labels(request.model_id).inc()
        events.record("optim", model=request.model_id, seconds=round(time.monotonic() - started, 4))
        return result

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        with self.metrics.sample_in_flight.track_inprogress():
            out = await self.inner.sample(target, prompt, params, num_samples, logprobs)
        self.metrics.generated_tokens.inc(sum(len(seq.tokens) for seq in out.sequences))
        return out

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        with self.metrics.sample_in_flight.track_inprogress():
            async for chunk in self.inner.stream_sample(target, prompt, params, num_samples):
                self.metrics.generated_tokens.inc(len(chunk.tokens))
                yield chunk

    # ---- the rest of the Runtime protocol, unchanged --------------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        return self.inner.model_cards()

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        await self.inner.create_model(model_id, base_model, lora)

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        await self.inner.save_state(model_id, path, with_optimizer)

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        await self.inner.load_state(model_id, path, with_optimizer)

    async def save_for_sampler(self, model_id: str, path: Path) -> Awaitable[None] | None:
        return await self.inner.save_for_sampler(model_id, path)

    async def save_external(self, model_id: str, path: Path) -> None:
        await self.inner.save_external(model_id, path)

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> Sequence[TimedPart] | None:
        return await self.inner.publish_sampler(model_id, target)

    async def release_model(self, model_id: str) -> None:
        await self.inner.release_model(model_id)

    def health_problem(self) -> str | None:
        return self.inner.health_problem()

    async def close(self) -> None:
        await self.inner.close()

    # ---- optional capabilities: the wrapped runtime's, or the answers for one without them -----------

    def operation_timed_out(self, model_id: str, operation: str, cause: str) -> None:
        seam.report_operation_timeout(self.inner, model_id, operation, cause)

    def sampling_lane(self, target: SamplerTarget) -> str:
        return seam.sampling_lane_of(self.inner, target)

    def sampling_lane_timed_out(self, lane: str, cause: str) -> None:
        seam.report_sampling_timeout(self.inner, lane, cause)

    def watch_training_queue(self, waiting: Callable[[], int]) -> None:
        seam.watch_training_queue(self.inner, waiting)

    def elastic_status(self) -> dict[str, Any] | None:
        return seam.elastic_of(self.inner)

    def catalog(self) -> dict[str, Any] | None:
        return seam.catalog_of(self.inner)

    def degradation(self) -> str | None:
        return seam.degradation_of(self.inner)
