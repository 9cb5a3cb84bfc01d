"""Trainer side of the colocated weight push: each rank hands the engine on its own GPU handles to its
weights (CUDA IPC; shared-memory files on CPU), no NCCL group (docs/colocation.md).

NCCL cannot put two processes on one GPU into one group, and it need not: the engine maps the trainer's
memory and copies each tensor into its own parameters. `ShareWeightBuckets` answers every bucket's payload
in the shape of SGLang's `/update_weights_from_tensor` (miles.utils.tensor_ipc); the tensors stay alive on
the rank (`_SHARED`) until `ReleaseSharedWeights` (which the driver runs once every engine answered, when
buckets were copied, or when the push failed) or the next share: an IPC handle to memory the trainer freed
would be read after free.

Flattened (the default, `PushConfig.flattened`; on CUDA only, `copy_pays`): each bucket is copied into one
buffer and crosses as SGLang's `load_format="flattened_bucket"`, one IPC handle per bucket instead of one per
tensor (each handle costs the trainer an IPC event and the engine a mapping of the trainer's memory;
hundreds a push). The copy takes memory for one push's worth of buckets until the engines answered; then
the trainer frees it into its allocator's cache (its next step reuses that memory) or, asked to
(`to_device`), empties the cache so that the memory goes back to the device before any engine resumes its
KV cache. A bucket whose copy does not fit goes as handles to the weights themselves.

The plan (the walk of the weights, the buckets, each copied bucket's views and metadata) is kept while
the weights stay where they are (`_SharePlan`): a push then packs each bucket with one `cat` and pickles
one handle, no Python per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles.train.backends.base import TrainBackend
from miles.train.commands import TrainerCommand
from miles.utils.buckets import TensorMeta, plan_buckets
from miles.utils.step_clock import StepClock
from miles.utils.tensor_ipc import (
    FlattenedLayout,
    flattened_layout,
    serialize_flattened_bucket,
    serialize_named_tensors,
)
from miles.weights.sender import RANK_SENDER

# The tensors whose handles the last ShareWeightBuckets gave out, kept until ReleaseSharedWeights; and
# which of them are flattened buckets' copies (memory of their own, given back once released).
_SHARED: list[torch.Tensor] = []
_COPIES: list[torch.Tensor] = []

Weights = tuple[tuple[str, torch.Tensor], ...]


@dataclass(frozen=True)
class SharedBuckets:
    """One rank's answer: each bucket's payload (base64 text), its tensor count, bytes and SGLang
    `load_format` ("flattened_bucket", or None for handles per tensor); or `error` when this rank could not
    share its weights (returned, not raised: it fails the push, not the trainer, whose cell would otherwise
    be marked dead and end the job). `seconds`: where the rank's time went (plan: walking the weights and
    planning the buckets, or only checking that the weights stay where they were while the kept plan
    holds; pack: launching the copies; handles: the IPC handles and their pickles)."""

    payloads: list[str]
    tensors: list[int]
    bytes: list[int]
    error: str | None = None
    load_formats: list[str | None] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class _Bucket:
    named: Weights
    nbytes: int
    layout: FlattenedLayout | None  # copied buckets: their views and SGLang metadata


@dataclass(frozen=True, eq=False)
class _SharePlan:
    """The buckets of one walk of the weights, for the next push of the same walk (RANK_SENDER.walk hands
    back the same tuple while the weights stay where they are), bucket size and form: a push then spends
    no Python per tensor (the 0.6B has 310)."""

    weights: Weights
    key: tuple[int, bool]  # bucket bytes, copied
    buckets: tuple[_Bucket, ...]
    reusable: bool  # every bucket's tensors are the weights' own memory (no contiguous copy to go stale)

    @classmethod
    def of(cls, weights: Weights, bucket_bytes: int, copies: bool) -> _SharePlan:
        by_name = {name: tensor.contiguous() for name, tensor in weights}
        metas = [TensorMeta.of(name, tensor) for name, tensor in weights]
        buckets = []
        for bucket in plan_buckets(metas, bucket_bytes, flattened=copies):
            named = tuple((meta.name, by_name[meta.name]) for meta in bucket)
            layout = flattened_layout(named) if copies else None
            buckets.append(_Bucket(named, sum(meta.nbytes for meta in bucket), layout))
        own = all(by_name[name] is tensor for name, tensor in weights)
        return cls(weights, (bucket_bytes, copies), tuple(buckets), own)


# The plans of the last walk, by (bucket bytes, copied); a new walk drops them.
_PLANS: dict[tuple[int, bool], _SharePlan] = {}


def _share_plan(weights: Weights, bucket_bytes: int, copies: bool) -> _SharePlan:
    key = (bucket_bytes, copies)
    kept = _PLANS.get(key)
    if kept is not None and kept.weights is weights:
        return kept
    if any(plan.weights is not weights for plan in _PLANS.values()):
        _PLANS.clear()
    plan = _SharePlan.of(weights, bucket_bytes, copies)
    if plan.reusable:
        _PLANS[key] = plan
    return plan


@dataclass(frozen=True)
class ShareWeightBuckets(TrainerCommand[SharedBuckets]):
    """Every rank: its current weights (iter_hf_weights) in buckets of at most `bucket_bytes`, each one
    payload of IPC handles. Runs on every rank: each serves the engine on its own GPU."""

    bucket_bytes: int
    flattened: bool = True

    def run(self, backend: TrainBackend) -> SharedBuckets:
        _let_go()
        try:
            return self._share(backend)
        except Exception as exc:  # e.g. CUDA IPC refused by the driver: the push's failure
            _let_go()
            return SharedBuckets([], [], [], error=f"{type(exc).__name__}: {exc}")

    def _share(self, backend: TrainBackend) -> SharedBuckets:
        clock = StepClock()
        with clock("plan"):
            # each piece of memory once (a tied lm_head is the embedding: the engine ties it the same way)
            weights, _ = RANK_SENDER.walk(backend)
            if not weights:
                raise RuntimeError("the trainer has no weights to push (iter_hf_weights yielded nothing)")
            plan = _share_plan(weights, self.bucket_bytes, self.flattened and copy_pays(weights))
        _SHARED.extend(tensor for bucket in plan.buckets for _, tensor in bucket.named)
        answers = [_payload(bucket, clock) for bucket in plan.buckets]
        return SharedBuckets(
            payloads=[payload for payload, _ in answers],
            tensors=[len(bucket.named) for bucket in plan.buckets],
            bytes=[bucket.nbytes for bucket in plan.buckets],
            load_formats=[load_format for _, load_format in answers],
            seconds=clock.steps,
        )


def _payload(bucket: _Bucket, clock: StepClock) -> tuple[str, str | None]:
    if bucket.layout is not None:
        try:
            with clock("pack"):
                buffer = bucket.layout.pack()
        except torch.OutOfMemoryError:  # no room for the copy: handles to the weights themselves
            pass
        else:
            _SHARED.append(buffer)
            _COPIES.append(buffer)
            with clock("handles"):
                return serialize_flattened_bucket(buffer, bucket.layout.metadata), "flattened_bucket"
    with clock("handles"):
        return serialize_named_tensors(list(bucket.named)), None


def copy_pays(named: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """A bucket copy saves IPC handles on CUDA (measured 0.80x the push of handles per tensor, the 0.6B on
    one H100). On CPU a copy is a new shared-memory file per push, where each parameter's own storage moves
    to shared memory once (the first push) and costs nothing after (11.7x slower copied, the same model)."""
    return named[0][1].is_cuda


@dataclass(frozen=True)
class ReleaseSharedWeights(TrainerCommand[int]):
    """The engines have copied what the last ShareWeightBuckets shared: let its tensors go. The count.
    `to_device`: after bucket copies, empty the allocator's cache too, so that their memory goes back to
    the device, where the engines' KV cache is about to go (every unused cached block goes with it: the
    next training step allocates its activations anew, as after an offload)."""

    to_device: bool = False

    def run(self, backend: TrainBackend) -> int:
        count = len(_SHARED)
        _let_go(empty_cache=self.to_device)
        return count


def _let_go(*, empty_cache: bool = False) -> None:
    copies = bool(_COPIES)
    _SHARED.clear()
    _COPIES.clear()
    if copies and empty_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
