"""The trainer's commands, defined once: each is a frozen dataclass (its arguments) whose `run` calls one
TrainBackend method on one rank and returns that method's result (its type parameter).

Who runs them (a TrainerClient):
  - InProcessTrainer (miles.train.in_process): one backend in this process, commands on its dedicated thread;
    the LocalRuntime uses it.
  - TrainerController (miles.train.controller): the first alive Ray trainer cell, which sends the command
    object to every rank's TrainerWorker.execute; the RayRuntime and the weight push use it.

So the request path reads: gateway -> Runtime -> TrainerClient.run(ForwardBackward(...)) -> on each rank
ForwardBackward.run(backend) -> backend.forward_backward(...). Commands travel to Ray actors by pickle,
so they hold plain data only.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.train import write_behind
from miles.train.backends.base import OffloadsTrainState, StagesHfWeights, TrainBackend
from miles.types import ForwardBackwardOutput, LoraSpec

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class TrainerCommand(ABC, Generic[R_co]):
    """One command; `run` executes it on one rank's backend."""

    # Data parallel ranks all run a command unless it is rank 0's alone (the weight push sends from rank
    # 0 only); the other ranks then answer None without running it.
    rank0_only: ClassVar[bool] = False

    @abstractmethod
    def run(self, backend: TrainBackend) -> R_co: ...

    def combine(self, results: Sequence[Any]) -> R_co:
        """The command's answer from every rank's result, in rank order: rank 0's."""
        return results[0]

    @property
    def name(self) -> str:
        """The command's name in errors and logs, e.g. ForwardBackward -> forward_backward."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()


class TrainerClient(Protocol):
    """Runs trainer commands: `await trainer.run(OptimStep(key, adam))` returns that command's result."""

    async def run(self, command: TrainerCommand[R]) -> R: ...


# ---- model keys -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateAdapter(TrainerCommand[None]):
    key: str
    spec: LoraSpec

    def run(self, backend: TrainBackend) -> None:
        backend.create_adapter(self.key, self.spec)


@dataclass(frozen=True)
class RemoveAdapter(TrainerCommand[None]):
    key: str

    def run(self, backend: TrainBackend) -> None:
        backend.remove_adapter(self.key)


@dataclass(frozen=True)
class HasAdapter(TrainerCommand[bool]):
    key: str

    def run(self, backend: TrainBackend) -> bool:
        return backend.has_adapter(self.key)


@dataclass(frozen=True)
class ModelKeys(TrainerCommand[list[str]]):
    def run(self, backend: TrainBackend) -> list[str]:
        return backend.model_keys()


@dataclass(frozen=True)
class Reset(TrainerCommand[None]):
    key: str

    def run(self, backend: TrainBackend) -> None:
        backend.reset(self.key)


# ---- training ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBackward(ForwardBackwardRequest, TrainerCommand[ForwardBackwardOutput]):
    """The runtime's request, run on every rank: it travels as it came (its fields are the request's)."""

    @classmethod
    def of(cls, request: ForwardBackwardRequest) -> ForwardBackward:
        return cls(*_request_fields(request, ForwardBackwardRequest))

    @property
    def key(self) -> str:
        """The model, by the name every command gives it (the backend's key)."""
        return self.model_id

    def run(self, backend: TrainBackend) -> ForwardBackwardOutput:
        started = time.perf_counter_ns()
        out = backend.forward_backward(
            self.model_id, self.data, self.loss_fn, self.loss_config, forward_only=self.forward_only
        )
        out.compute_ns = time.perf_counter_ns() - started
        return out

    def combine(self, results: Sequence[Any]) -> ForwardBackwardOutput:
        """Rank 0's output, with every rank's compute time (the session trace shows each rank)."""
        return with_rank_times(results[0], results)


@dataclass(frozen=True)
class OptimStep(OptimStepRequest, TrainerCommand[dict[str, float]]):
    """The runtime's request, run on every rank."""

    @classmethod
    def of(cls, request: OptimStepRequest) -> OptimStep:
        return cls(*_request_fields(request, OptimStepRequest))

    @property
    def key(self) -> str:
        """The model, by the name every command gives it (the backend's key)."""
        return self.model_id

    def run(self, backend: TrainBackend) -> dict[str, float]:
        return backend.optim_step(self.model_id, self.adam)


def _request_fields(request: object, kind: type) -> tuple[object, ...]:
    """`request`'s values of `kind`'s fields, in order: a subclass's own fields are not the request's."""
    return tuple(getattr(request, f.name) for f in fields(kind))


# ---- files ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveState(TrainerCommand[None]):
    key: str
    path: Path
    with_optimizer: bool

    def run(self, backend: TrainBackend) -> None:
        backend.save_state(self.key, self.path, with_optimizer=self.with_optimizer)


@dataclass(frozen=True)
class LoadState(TrainerCommand[None]):
    key: str
    path: Path
    with_optimizer: bool

    def run(self, backend: TrainBackend) -> None:
        backend.load_state(self.key, self.path, with_optimizer=self.with_optimizer)


@dataclass(frozen=True)
class ExportAdapter(TrainerCommand[None]):
    """A PEFT directory of adapter `key` (the LoRA sampler snapshot)."""

    key: str
    path: Path

    def run(self, backend: TrainBackend) -> None:
        backend.export_adapter(self.key, self.path)


@dataclass(frozen=True)
class StageHfWeights(TrainerCommand[bool]):
    """The full-weight sampler snapshot written behind (miles.train.write_behind): the host copy now, the
    files into `path` from a thread, then the marker the gateway waits for. True when so; False when the
    backend cannot stage and the files were written before this answered (export_hf_weights)."""

    path: Path

    def run(self, backend: TrainBackend) -> bool:
        if not isinstance(backend, StagesHfWeights):
            backend.export_hf_weights(self.path)
            return False
        write_behind.WRITES.wait()  # the copy being written first: one host copy in memory, not several
        write = backend.stage_hf_weights()
        if write is not None:
            write_behind.WRITES.start(self.path, write)
        return True


@dataclass(frozen=True)
class ExportMergedHfWeights(TrainerCommand[None]):
    """Model `key` as a standalone HF safetensors directory (LoRA: merged into the base), for
    save_weights_external."""

    key: str
    path: Path

    def run(self, backend: TrainBackend) -> None:
        backend.export_merged_hf_weights(self.key, self.path)


# ---- colocation (docs/colocation.md) -------------------------------------------------------------


@dataclass(frozen=True)
class PrepareForSampling(TrainerCommand[dict[str, int]]):
    """The engines on this trainer's GPUs are about to sample: move `offload` ("optimizer", "gradients")
    to host memory and give the freed blocks back. Bytes moved per kind ({} for a backend that cannot)."""

    offload: tuple[str, ...]

    def run(self, backend: TrainBackend) -> dict[str, int]:
        if not isinstance(backend, OffloadsTrainState) or not self.offload:
            return {}
        return backend.offload_train_state(self.offload)


@dataclass(frozen=True)
class PrepareForTraining(TrainerCommand[int]):
    """Training resumes on the GPUs: put back what PrepareForSampling moved; the bytes moved."""

    def run(self, backend: TrainBackend) -> int:
        return backend.reload_train_state() if isinstance(backend, OffloadsTrainState) else 0


# ---- diagnostics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sleep(TrainerCommand[None]):
    """Hold every rank busy (fault drills: kill or cancel a command while it runs)."""

    seconds: float

    def run(self, backend: TrainBackend) -> None:
        time.sleep(self.seconds)


def with_rank_times(out: ForwardBackwardOutput, per_rank: Sequence[Any]) -> ForwardBackwardOutput:
    """`out` carrying each rank's compute time, from that rank's output of the same request."""
    out.rank_compute_ns = tuple(r.compute_ns for r in per_rank if isinstance(r, ForwardBackwardOutput))
    return out
