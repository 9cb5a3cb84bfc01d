"""The seam between the gateway and whatever runs models (Ray cells, the local runtime, test doubles).

The gateway only ever awaits these methods; it never touches Ray, trainers or engines. Errors: a
`miles.errors.MilesError` carries its category (`UserError`: the caller's fault, "user"); anything else
is "server".
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from miles.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
)


@dataclass(frozen=True)
class ModelCard:
    """A base model the runtime serves, as advertised by get_server_capabilities and /v1/models."""

    name: str  # what clients send as base_model, e.g. "Qwen/Qwen3-8B"
    max_context: int
    trainable: bool
    sampleable: bool
    train_mode: str  # "lora" | "full"
    tokenizer_id: str  # what the SDK passes to AutoTokenizer (name or local directory)
    tokenizer_path: str | None = None  # local HF directory the gateway loads the chat template from
    arch: str | None = None  # the config's model_type (get_info's model_data.arch)
    max_lora_rank: int | None = None  # the largest LoRA rank the engines serve (None: no limit)


@dataclass(frozen=True)
class SamplerTarget:
    """What to sample from: the base model itself, or an immutable sampler snapshot on disk."""

    base_model: str
    snapshot_path: Path | None = None  # None = the base model's weights
    snapshot_id: str | None = None  # stable name of the snapshot (its tinker:// path)


@runtime_checkable
class Runtime(Protocol):
    def model_cards(self) -> list[ModelCard]: ...  # cheap, no I/O: called on many requests

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None: ...

    async def forward_backward(
        self,
        model_id: str,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, Any],
        forward_only: bool,
    ) -> ForwardBackwardOutput: ...

    async def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]: ...

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None: ...

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None: ...

    async def save_for_sampler(self, model_id: str, path: Path) -> None:
        """Write the sampler snapshot's files into `path` (a staging directory the gateway commits)."""
        ...

    async def save_external(self, model_id: str, path: Path) -> None:
        """Write the model as a standalone HF safetensors directory into `path` (LoRA: merged into the
        base; full: the trained weights), for save_weights_external."""
        ...

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> None:
        """Make a committed snapshot servable (load the adapter, or push the full weights)."""
        ...

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput: ...

    def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        """The same samples as `sample`, as chunks of new tokens while the engine produces them; closing
        the iterator early aborts the generations."""
        ...

    async def release_model(self, model_id: str) -> None: ...

    def health_problem(self) -> str | None: ...

    async def close(self) -> None: ...


def report_operation_timeout(runtime: Runtime, model_id: str, operation: str, cause: str) -> None:
    """The gateway cut `operation` on `model_id` at its execution timeout (the operation is cancelled
    already). The runtime's optional `operation_timed_out(model_id, operation, cause)` hears it: it must
    not block (schedule its work) and may ignore it. A catalog job quarantines the handle's instance
    (docs/catalog.md); a runtime of one model has nothing to do, so it need not have the method."""
    hook = getattr(runtime, "operation_timed_out", None)
    if callable(hook):
        hook(model_id, operation, cause)


def report_sampling_timeout(runtime: Runtime, lane: str, cause: str) -> None:
    """The gateway cut a sample on sampling lane `lane` (`sampling_lane_of`) at its execution timeout.
    Samples carry no model id, so the lane says where it hung. The runtime's optional
    `sampling_lane_timed_out(lane, cause)` hears it (must not block): a catalog job quarantines the
    instance that is the lane; a runtime of one lane need not have the method."""
    hook = getattr(runtime, "sampling_lane_timed_out", None)
    if callable(hook):
        hook(lane, cause)


def watch_training_queue(runtime: Runtime, waiting: Callable[[], int]) -> None:
    """Hand the runtime the gateway's count of queued training operations, through its optional
    `watch_training_queue` (the Ray runtime's elastic driver reads it to decide when to borrow)."""
    watch = getattr(runtime, "watch_training_queue", None)
    if callable(watch):
        watch(waiting)


def elastic_of(runtime: Runtime) -> dict[str, Any] | None:
    """Elastic training's lanes and GPU owners (`ElasticDriver.status`), from the runtime's optional
    `elastic_status()`; None where elastic training is off or not supported."""
    status = getattr(runtime, "elastic_status", None)
    return status() if callable(status) else None


ONE_LANE = ""  # the sampling lane of a runtime whose samples all run on one set of engines


def sampling_lane_of(runtime: Runtime, target: SamplerTarget) -> str:
    """Which of the runtime's sets of engines a sample of `target` runs on: the gateway's
    max_concurrent_samples applies per lane. From the runtime's optional `sampling_lane(target)` (a
    catalog job: the instance's id); a runtime of one model has one lane and need not have the method."""
    lane = getattr(runtime, "sampling_lane", None)
    return lane(target) if callable(lane) else ONE_LANE


def catalog_of(runtime: Runtime) -> dict[str, Any] | None:
    """The runtime's model catalog as plain data (models, instances, tenants, the free pool), from its
    optional `catalog()` method; None for a runtime without a catalog (one model, fixed at bring-up).
    The shape: `miles.catalog.controller.CatalogController.snapshot`, documented in docs/catalog.md."""
    catalog = getattr(runtime, "catalog", None)
    return catalog() if callable(catalog) else None
