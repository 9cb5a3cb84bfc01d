"""MeteredRuntime: any Runtime, with its training and sampling measured (metrics + the event log).

The composition sites wrap the runtime they built (`miles.driver.bringup` for jobs, the local server)
before handing it to the gateway, so every runtime is measured the same way and the gateway itself stays
unaware. Everything not measured here passes straight through to the wrapped runtime.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from miles.contract import events
from miles.errors import MilesError
from miles.observability.metrics import JobMetrics, job_metrics
from miles.types import AdamParams, Datum, ForwardBackwardOutput, SampleChunk, SampleOutput


def batch_tokens(data: list[Datum]) -> int:
    return sum(len(datum.model_input) for datum in data)


def mean_token_loss(out: ForwardBackwardOutput, data: list[Datum]) -> float | None:
    """loss:sum over the batch's total weight (the loss the demo and the cookbook print)."""
    total = out.metrics.get("loss:sum")
    if total is None:
        return None
    weight = sum(float(d.loss_fn_inputs["weights"].sum()) for d in data if "weights" in d.loss_fn_inputs)
    return float(total) / (weight if weight > 0 else max(batch_tokens(data), 1))


def is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, MilesError) and exc.category.reported == "user"


class MeteredRuntime:
    def __init__(self, inner: Any, metrics: JobMetrics | None = None) -> None:
        self.inner = inner
        self.metrics = metrics or job_metrics()

    def __getattr__(self, name: str) -> Any:  # the rest of the Runtime protocol, unchanged
        return getattr(self.inner, name)

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

    async def forward_backward(
        self, model_id: str, data: list[Datum], loss_fn: str, loss_config: dict[str, Any], forward_only: bool
    ) -> ForwardBackwardOutput:
        command = "forward" if forward_only else "forward_backward"
        started = time.monotonic()
        with self._command(model_id, command):
            out = await self.inner.forward_backward(model_id, data, loss_fn, loss_config, forward_only)
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

    async def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]:
        started = time.monotonic()
        with self._command(model_id, "optim_step"):
            result = await self.inner.optim_step(model_id, adam)
        self.metrics.optim_steps.labels(model_id).inc()
        events.record("optim", model=model_id, seconds=round(time.monotonic() - started, 4))
        return result

    async def sample(self, target: Any, prompt: list[int], params: Any, num_samples: int, logprobs: Any):
        with self.metrics.sample_in_flight.track_inprogress():
            out: SampleOutput = await self.inner.sample(target, prompt, params, num_samples, logprobs)
        self.metrics.generated_tokens.inc(sum(len(seq.tokens) for seq in out.sequences))
        return out

    async def stream_sample(
        self, target: Any, prompt: list[int], params: Any, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        with self.metrics.sample_in_flight.track_inprogress():
            async for chunk in self.inner.stream_sample(target, prompt, params, num_samples):
                self.metrics.generated_tokens.inc(len(chunk.tokens))
                yield chunk
