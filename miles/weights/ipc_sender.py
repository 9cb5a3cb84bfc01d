"""Trainer side of the colocated weight push: each rank hands the engine on its own GPU handles to its
weights (CUDA IPC; shared-memory files on CPU), no copy and no NCCL group (docs/colocation.md).

NCCL cannot put two processes on one GPU into one group, and it need not: the engine maps the trainer's
memory and copies each tensor into its own parameters. `ShareWeightBuckets` answers every bucket's payload
in the shape of SGLang's `/update_weights_from_tensor` (miles.utils.tensor_ipc); the tensors stay alive on
the rank (`_SHARED`) until `ReleaseSharedWeights`, which the driver runs once every engine answered (or
the push failed): an IPC handle to memory the trainer freed would be read after free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.train.backends.base import TrainBackend
from miles.train.commands import TrainerCommand
from miles.utils.buckets import TensorMeta, plan_buckets
from miles.utils.tensor_ipc import serialize_named_tensors
from miles.weights.sender import pushed_weights

# The tensors whose handles the last ShareWeightBuckets gave out, kept until ReleaseSharedWeights.
_SHARED: list[torch.Tensor] = []


@dataclass(frozen=True)
class SharedBuckets:
    """One rank's answer: each bucket's payload (base64 text), its tensor count and bytes; or `error`
    when this rank could not share its weights (returned, not raised: it fails the push, not the trainer,
    whose cell would otherwise be marked dead and end the job)."""

    payloads: list[str]
    tensors: list[int]
    bytes: list[int]
    error: str | None = None


@dataclass(frozen=True)
class ShareWeightBuckets(TrainerCommand[SharedBuckets]):
    """Every rank: its current weights (iter_hf_weights) in buckets of at most `bucket_bytes`, each one
    payload of IPC handles. Runs on every rank: each serves the engine on its own GPU."""

    bucket_bytes: int

    def run(self, backend: TrainBackend) -> SharedBuckets:
        _SHARED.clear()
        try:
            return self._share(backend)
        except Exception as exc:  # e.g. CUDA IPC refused by the driver: the push's failure
            _SHARED.clear()
            return SharedBuckets([], [], [], error=f"{type(exc).__name__}: {exc}")

    def _share(self, backend: TrainBackend) -> SharedBuckets:
        # each piece of memory once (a tied lm_head is the embedding: the engine ties it the same way)
        weights = [(name, tensor.detach().contiguous()) for name, tensor in pushed_weights(backend)]
        if not weights:
            raise RuntimeError("the trainer has no weights to push (iter_hf_weights yielded nothing)")
        by_name = dict(weights)
        metas = [TensorMeta.of(name, tensor) for name, tensor in weights]
        payloads, counts, sizes = [], [], []
        for bucket in plan_buckets(metas, self.bucket_bytes):
            named = [(meta.name, by_name[meta.name]) for meta in bucket]
            payloads.append(serialize_named_tensors(named))
            counts.append(len(named))
            sizes.append(sum(t.numel() * t.element_size() for _, t in named))
        _SHARED.extend(by_name.values())
        return SharedBuckets(payloads, counts, sizes)


@dataclass(frozen=True)
class ReleaseSharedWeights(TrainerCommand[int]):
    """The engines have copied what the last ShareWeightBuckets shared: let its tensors go. The count."""

    def run(self, backend: TrainBackend) -> int:
        count = len(_SHARED)
        _SHARED.clear()
        return count
