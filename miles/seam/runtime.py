"""The seam between the gateway and whatever runs models (Ray cells, the local runtime, test doubles).

The gateway only ever awaits these methods; it never touches Ray, trainers or engines. Errors: a
`miles.errors.MilesError` carries its category (`UserError`: the caller's fault, "user"); anything else
is "server". What only some runtimes can do is declared in miles.seam.capabilities and asked for through
the helpers at the end of this module; the training calls take miles.seam.requests values.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from miles.seam.capabilities import (
    ElasticTraining,
    ModelCatalog,
    OperationTimeouts,
    SamplingLanes,
    ServingDegradation,
)
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.types import (
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
    TimedPart,
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
    """What to sample from: the base model itself, an immutable sampler snapshot on disk, or (full
    fine-tuning, an unnamed save) an ephemeral snapshot: the trainer's weights as they were at the save,
    pushed to the engines and never written; `snapshot_id` is then its only identity."""

    base_model: str
    snapshot_path: Path | None = None  # None = the base model's weights (or an ephemeral snapshot)
    snapshot_id: str | None = None  # stable name of the snapshot (its tinker:// path, or ephemeral id)
    ephemeral: bool = False  # no files: a full-weight runtime serves it while the trainer has not moved
    # the context a `<base>:peft:<context>` model id asked for (the gateway enforces it; None: the base's)
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.ephemeral and (self.snapshot_id is None or self.snapshot_path is not None):
            raise ValueError("an ephemeral sampler snapshot has a snapshot_id and no snapshot_path")

    @property
    def is_base(self) -> bool:
        """The base model's own weights (no snapshot of any kind)."""
        return self.snapshot_path is None and not self.ephemeral

    def snapshot_key(self) -> str | None:
        """The snapshot's identity in a runtime: the resolved directory of a snapshot on disk, the id of
        an ephemeral one; None for the base model."""
        if self.ephemeral:
            return self.snapshot_id
        return None if self.snapshot_path is None else str(Path(self.snapshot_path).resolve())


@runtime_checkable
class Runtime(Protocol):
    def model_cards(self) -> list[ModelCard]: ...  # cheap, no I/O: called on many requests

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None: ...

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput: ...

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]: ...

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None: ...

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None: ...

    async def save_for_sampler(self, model_id: str, path: Path) -> Awaitable[None] | None:
        """Write the sampler snapshot's files into `path` (a staging directory the gateway commits). None:
        they are written. An awaitable: they are being written behind (the snapshot is taken: the weights
        may change now), and it completes when they are whole or raises why they could not be."""
        ...

    async def save_external(self, model_id: str, path: Path) -> None:
        """Write the model as a standalone HF safetensors directory into `path` (LoRA: merged into the
        base; full: the trained weights), for save_weights_external."""
        ...

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> Sequence[TimedPart] | None:
        """Make a committed snapshot servable (load the adapter, or push the full weights); an ephemeral
        target (full fine-tuning only) has no files: the push of the trainer's weights is the snapshot.
        Returns how that went (the push's buckets, the adapter load) for the session trace, if it knows."""
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


@runtime_checkable
class SupervisedRuntime(Runtime, Protocol):
    """What the driver's probe loop (miles.driver.serve.wait_for_shutdown) asks of the runtime it brought
    up: a runtime whose trainers it can watch, and end the job when they are gone."""

    async def probe_trainers(self, timeout_s: float) -> bool:
        """Probe the trainer cells, bounded by `timeout_s` each; False once the job has no trainer to
        serve with (health_problem() then says why)."""
        ...

    def trainer_liveness(self) -> list[tuple[int, bool]]:
        """(cell index, alive) of each trainer cell whose death ends the job, as the last probe left it."""
        ...


def report_operation_timeout(runtime: Runtime, model_id: str, operation: str, cause: str) -> None:
    """The gateway cut `operation` on `model_id` at its execution timeout (the operation is cancelled
    already). A runtime with `OperationTimeouts` hears it; a runtime of one model has nothing to
    quarantine, so it need not have it."""
    if isinstance(runtime, OperationTimeouts):
        runtime.operation_timed_out(model_id, operation, cause)


def report_sampling_timeout(runtime: Runtime, lane: str, cause: str) -> None:
    """The gateway cut a sample on sampling lane `lane` (`sampling_lane_of`) at its execution timeout. A
    runtime with `SamplingLanes` hears it (a catalog job quarantines the instance that is the lane); a
    runtime of one lane need not have it."""
    if isinstance(runtime, SamplingLanes):
        runtime.sampling_lane_timed_out(lane, cause)


def watch_training_queue(runtime: Runtime, waiting: Callable[[], int]) -> None:
    """Hand a runtime with `ElasticTraining` the gateway's count of queued training operations (the Ray
    runtime's elastic driver reads it to decide when to borrow)."""
    if isinstance(runtime, ElasticTraining):
        runtime.watch_training_queue(waiting)


def elastic_of(runtime: Runtime) -> dict[str, Any] | None:
    """Elastic training's lanes and GPU owners (`ElasticDriver.status`); None where elastic training is
    off or not supported."""
    return runtime.elastic_status() if isinstance(runtime, ElasticTraining) else None


ONE_LANE = ""  # the sampling lane of a runtime whose samples all run on one set of engines


def sampling_lane_of(runtime: Runtime, target: SamplerTarget) -> str:
    """Which of the runtime's sets of engines a sample of `target` runs on: the gateway's
    max_concurrent_samples applies per lane. A runtime without `SamplingLanes` has one lane."""
    return runtime.sampling_lane(target) if isinstance(runtime, SamplingLanes) else ONE_LANE


def catalog_of(runtime: Runtime) -> dict[str, Any] | None:
    """The runtime's model catalog as plain data (`ModelCatalog`); None for a runtime without a catalog
    (one model, fixed at bring-up)."""
    return runtime.catalog() if isinstance(runtime, ModelCatalog) else None


def degradation_of(runtime: Runtime) -> str | None:
    """What keeps a live runtime from serving fully (`ServingDegradation`); None for a runtime without the
    capability or with nothing wrong."""
    return runtime.degradation() if isinstance(runtime, ServingDegradation) else None
