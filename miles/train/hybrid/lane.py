"""HybridLane: one data-parallel replica of the trainable state, on the core's GPUs or on a borrowed engine's.

Plain Python (a Ray actor in production and tests: `ray.remote(HybridLane)`). The lane with rank 0 of every
membership is the core lane: it hosts the store and is the source of state for joiners. Counters per model
key: `step` (optimizer steps released) and `version` (bumped by every release and every state transfer),
which with the membership epoch stamp what a step's gradients were computed against.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as torch_dist

from miles.train.backends.base import TrainBackend
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.dist import DistContext
from miles.train.hybrid.fence import (
    Delivery,
    DeliveryRejected,
    RecentNonces,
    Stamp,
    StateDiverged,
    StepFence,
)
from miles.train.hybrid.group import (
    LaneGroup,
    Membership,
    chunk_segments,
    connect_store,
    gather_segments,
    open_store,
    scatter_segments,
)
from miles.train.hybrid.replica import Replica, replica_for
from miles.train.hybrid.state import state_digest, state_fingerprint
from miles.train.preflight import preflight
from miles.train.worker import ACTOR_CONCURRENCY_GROUPS, HEALTH_GROUP, node_ip, resolve_dtype
from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec

log = logging.getLogger(__name__)
LANE_CONCURRENCY_GROUPS = ACTOR_CONCURRENCY_GROUPS
# A step's gradient sum runs in chunks of this many fp32 elements (64 MiB per temporary, and as much on
# the host for the lanes' gloo group), never a copy of the whole gradient.
REDUCE_CHUNK_ELEMENTS = 16 * 2**20


@dataclass(frozen=True)
class LaneShareResult:
    output: ForwardBackwardOutput | None  # None for an empty share
    tokens_per_s: float | None  # measured on this share (None when empty)


def _word(text: str) -> int:
    return zlib.crc32(text.encode())


class HybridLane:
    """Create the actor with `concurrency_groups=LANE_CONCURRENCY_GROUPS` (see `ping`)."""

    def __init__(self, lane: str, *, torch_threads: int = 1, group_timeout_s: float = 60.0) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(torch_threads))
        torch.set_num_threads(torch_threads)
        self.lane, self.run, self.group_timeout_s = lane, "", group_timeout_s
        self._store: Any = None
        self._group: LaneGroup | None = None
        self._backend: TrainBackend | None = None
        self._replica: Replica | None = None
        # per trainable (an adapter key, or "full" for every key of a full-model trainer)
        self.step: dict[str, int] = defaultdict(int)
        self.version: dict[str, int] = defaultdict(int)
        self._seen_nonces = RecentNonces()

    # ---- bring-up and membership ------------------------------------------------------------------

    def setup(
        self, run: str, model_path: str, train_mode: str, backend_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """Load a fresh trainable for `run` (every delivery is stamped with it). `backend_kwargs["backend"]`:
        "transformers" (the default) or "megatron" (full fine-tuning at TP 1, a DP group of its own)."""
        kwargs = dict(backend_kwargs or {})
        kind = kwargs.pop("backend", "transformers")
        device = kwargs.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(kwargs.pop("dtype", torch.float32))
        if kind == "megatron":
            from miles.train.backends.megatron_backend import MegatronBackend

            backend: TrainBackend = MegatronBackend(
                model_path, train_mode=train_mode, device=device, dtype=dtype, **kwargs
            )
        else:
            backend = TransformersBackend(
                model_path, train_mode=train_mode, device=device, dtype=dtype, **kwargs
            )
        return self.adopt(run, backend)

    def adopt(self, run: str, backend: TrainBackend) -> str:
        """Serve as the core lane over a trainer rank's own backend (the core trainer cell's ranks): the
        same trainable the trainer commands change, nothing loaded twice. Also the end of `setup`: a fresh
        trainable, no epoch, no counters, no delivery history (a lane process may be reused)."""
        self.run, self._group, self._seen_nonces = run, None, RecentNonces()
        self.step.clear()
        self.version.clear()
        self._backend = backend
        self._replica = replica_for(backend)
        return self.lane

    def open_store(self) -> tuple[str, int]:
        """Core lane only: host the store every epoch's group meets through."""
        host = node_ip()
        self._store = open_store(host, self.group_timeout_s)
        return host, self._store.port

    def connect(self, host: str, port: int) -> None:
        self._store = connect_store(host, port, self.group_timeout_s)

    def join_epoch(self, membership: Membership) -> int:
        """Leave the old epoch's group and build this one's (blocks until every member joins)."""
        self._group = None  # the old group is dropped first: its epoch is over whatever happens next
        self._group = LaneGroup(self._store, membership, self.lane, self.group_timeout_s)
        return self._group.rank

    @property
    def backend(self) -> Any:
        if self._backend is None:
            raise RuntimeError("HybridLane.setup() has not run")
        return self._backend

    @property
    def replica(self) -> Replica:
        if self._replica is None:
            raise RuntimeError("HybridLane.setup() has not run")
        return self._replica

    @property
    def group(self) -> LaneGroup:
        if self._group is None:
            raise RuntimeError(f"lane {self.lane} is not in a membership epoch")
        return self._group

    def create_adapter(self, key: str, spec: LoraSpec) -> None:
        self.backend.create_adapter(key, spec)
        self.step[key], self.version[key] = 0, 0

    def take_adapter(self, key: str, spec: LoraSpec) -> None:
        """A joiner: the trainer's adapter, created afresh (a copy kept from an earlier membership of this
        process may have another spec; the state transfer then overwrites the values)."""
        self.remove_adapter(key)
        self.create_adapter(key, spec)

    def remove_adapter(self, key: str) -> None:
        """Gone from this lane too (a no-op where the trainer command removed it already: the core)."""
        if self.backend.has_adapter(key):
            self.backend.remove_adapter(key)
        self.step.pop(key, None)
        self.version.pop(key, None)

    def _trainable(self, key: str) -> str:
        return key if self.backend.train_mode == "lora" else "full"

    # ---- one step ---------------------------------------------------------------------------------

    def forward_backward(
        self,
        key: str,
        data: Sequence[Datum],
        share: tuple[int, int],
        loss_fn: str,
        loss_config: Mapping[str, float],
    ) -> LaneShareResult:
        """The whole batch is checked on every lane (a bad batch fails on all of them alike), then this
        lane runs its share; gradients accumulate until optim_step."""
        preflight(
            data,
            loss_fn,
            loss_config,
            vocab_size=self.backend.vocab_size,
            max_context=self.backend.max_context,
            max_batch_tokens=self.backend.max_batch_tokens,
        )
        mine = list(data[share[0] : share[1]])
        if not mine:
            return LaneShareResult(None, None)
        started = time.perf_counter()
        output = self.backend.forward_backward(key, mine, loss_fn, loss_config)
        tokens = sum(len(d.model_input) for d in mine)
        return LaneShareResult(output, tokens / max(time.perf_counter() - started, 1e-9))

    def optim_step(self, key: str, adam: AdamParams, stamp: Stamp, command_id: str) -> dict[str, float]:
        """Fence every lane's delivery, sum the gradients over the lanes' group, then step identically.

        The sum runs in chunks of at most REDUCE_CHUNK_ELEMENTS (fp32) gathered from the gradients and
        written back, so its temporaries stay bounded whatever the model's size. A core of several ranks
        (every core rank gets this call): rank 0 alone fences and tells the others its verdict; then, per
        chunk, the ranks sum inside their own group, rank 0 adds the lanes' sum and broadcasts the result
        back over the core group, so the core's layout is never touched and every rank steps alike."""
        replica, trainable = self.replica, self._trainable(key)
        core = replica.core_dist()
        gradients = replica.gradients(key)
        self._agree_on_fence(core, trainable, stamp, command_id)
        sum_of_squares = self._sum_gradients(core, gradients, measure=replica.shared_norm)
        grad_norm = self._shared_norm(core, sum_of_squares) if replica.shared_norm else None
        metrics = replica.step(key, adam, grad_norm, core=core is not None)
        self.step[trainable] += 1
        self.version[trainable] += 1
        return metrics

    def _agree_on_fence(
        self, core: DistContext | None, trainable: str, stamp: Stamp, command_id: str
    ) -> None:
        """The fence's verdict on every replica (DeliveryRejected, the same everywhere). A core's rank 0
        sends its verdict even when the exchange raised (a lane died), so no other rank waits on a
        broadcast that would never come, then raises what it met."""
        if core is None:
            rejection = self._fence(trainable, stamp, command_id)
        else:
            rejection, failure = None, None
            if core.is_primary:
                try:
                    rejection = self._fence(trainable, stamp, command_id)
                except Exception as exc:
                    rejection, failure = f"the lanes' fence failed on the core's rank 0: {exc!r}", exc
            rejection = _verdict_from_core_rank0(core, rejection)
            if failure is not None:
                raise failure
        if rejection is not None:
            raise DeliveryRejected(rejection)

    def _sum_gradients(
        self, core: DistContext | None, gradients: list[torch.Tensor], *, measure: bool
    ) -> float:
        """Every replica's gradients summed in place, chunk by chunk; the sum of squares of the total as the
        lanes' rank 0 saw it when `measure` (0 elsewhere)."""
        measures = measure and self._group is not None and self._group.rank == 0
        sum_of_squares = 0.0
        for segments in chunk_segments(gradients, REDUCE_CHUNK_ELEMENTS):
            chunk = gather_segments(segments)
            if core is None:
                self.group.all_reduce_sum(chunk)
            else:
                torch_dist.all_reduce(chunk, op=torch_dist.ReduceOp.SUM, group=core.group)
                failure = None
                if core.is_primary:
                    try:
                        self.group.all_reduce_sum(chunk)
                    except Exception as exc:
                        failure = exc
                _chunk_from_core_rank0(core, chunk, failed=failure is not None)
                if failure is not None:
                    raise failure
            scatter_segments(chunk, segments)
            if measures:
                sum_of_squares += float(chunk.to(torch.float64).square().sum())
        return sum_of_squares

    def _shared_norm(self, core: DistContext | None, sum_of_squares: float) -> float:
        """The summed gradient's norm as the lanes' rank 0 measured it, on every replica: the lanes get it
        over their group, a core's other ranks from its rank 0."""
        norm = torch.tensor([math.sqrt(sum_of_squares)], dtype=torch.float64)
        if self._group is not None:
            self._group.broadcast(norm, 0)
        if core is not None:
            on_device = norm.to(_device_of(core))
            torch_dist.broadcast(on_device, 0, group=core.group)
            norm = on_device.cpu()
        return float(norm[0])

    def _fence(self, trainable: str, stamp: Stamp, command_id: str) -> str | None:
        """Every lane's delivery judged against this lane's own step: the rejection, or None (released)."""
        group = self.group
        expected = Stamp(self.run, group.membership.epoch, self.step[trainable], self.version[trainable])
        fence = StepFence(expected, frozenset(group.membership.lanes), self._seen_nonces)
        for delivery in self._exchange(Delivery(stamp, self.lane, f"{command_id}/{self.lane}")):
            fence.offer(delivery)
        if fence.rejections:
            fence.abort()
            return f"step {expected.step} rejected: " + "; ".join(fence.rejections)
        fence.release()
        return None

    def _exchange(self, mine: Delivery) -> list[Delivery]:
        """Every member's delivery header, in rank order (all lanes then judge the same list)."""
        group = self.group
        s = mine.stamp
        row = torch.tensor(
            [_word(s.run), s.epoch, s.step, s.version, group.rank, _word(mine.nonce)], dtype=torch.int64
        )
        deliveries = []
        for other in group.all_gather(row):
            run_word, epoch, step, version, rank, nonce = (int(v) for v in other.tolist())
            run = self.run if run_word == _word(self.run) else f"<run crc {run_word}>"
            lane = group.membership.lanes[rank]
            deliveries.append(Delivery(Stamp(run, epoch, step, version), lane, f"nonce-{nonce}"))
        return deliveries

    def abort_step(self, key: str) -> None:
        """Drop the pending gradients of a step that will be recomputed."""
        self.replica.drop_gradients(key)

    # ---- state ------------------------------------------------------------------------------------

    def receive_state(self, key: str) -> tuple[int, int]:
        """Collective: every member takes the core lane's (rank 0) state and counters for `key`."""
        trainable = self._trainable(key)
        self.replica.broadcast_state(self._group, key, root=0)
        if self._group is None:  # a sharded core's rank other than 0: it took part in the gather only
            return self.step[trainable], self.version[trainable]
        group = self.group
        counters = torch.tensor([self.step[trainable], self.version[trainable]], dtype=torch.int64)
        group.broadcast(counters, 0)
        # every member's state changed (the joiner's wholesale): a new version for all
        self.step[trainable], self.version[trainable] = int(counters[0]), int(counters[1]) + 1
        return self.step[trainable], self.version[trainable]

    def check_state(self, key: str) -> None:
        """Collective: raise StateDiverged on every lane unless all fingerprints agree."""
        entries = self.replica.state_entries(key)
        if entries is None:  # a sharded core's rank other than 0: it took part in the gather only
            return
        mine = state_fingerprint(entries)
        if not all(torch.equal(mine, theirs) for theirs in self.group.all_gather(mine)):
            raise StateDiverged(f"lane states differ for {key!r} at step {self.step[self._trainable(key)]}")

    def digest(self, key: str) -> str:
        entries = self.replica.state_entries(key)
        return "" if entries is None else state_digest(entries)

    def snapshot(self, key: str) -> dict[str, np.ndarray]:
        entries = self.replica.state_entries(key) or []
        return {name: t.detach().to("cpu").numpy().copy() for name, t in entries}

    def counters(self, key: str) -> tuple[int, int]:
        trainable = self._trainable(key)
        return self.step[trainable], self.version[trainable]

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> str:
        """Answered while a command runs (its own concurrency group): a lane stuck in a collective whose
        peer died is alive, and is told apart from the dead one."""
        return self.lane


def _device_of(core: DistContext) -> torch.device:
    """Where the core group's collectives take tensors (NCCL: the rank's GPU)."""
    backend = torch_dist.get_backend(core.group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _flag_from_core_rank0(core: DistContext, raised: bool, device: torch.device) -> bool:
    """Rank 0's flag, broadcast over the core group: every rank learns it, so none waits on a broadcast
    that rank 0 will not send."""
    flag = torch.tensor([1 if raised else 0], dtype=torch.int64, device=device)
    torch_dist.broadcast(flag, 0, group=core.group)
    return bool(flag.item())


def _verdict_from_core_rank0(core: DistContext, rejection: str | None) -> str | None:
    """Rank 0's fence verdict on every rank of the core."""
    if _flag_from_core_rank0(core, rejection is not None, _device_of(core)):
        return rejection or "the step was rejected on the core's rank 0 (its error names why)"
    return None


def _chunk_from_core_rank0(core: DistContext, chunk: torch.Tensor, *, failed: bool) -> None:
    """Rank 0's word on this chunk (its lanes' sum failed or not), then the chunk itself when it did not:
    a rank told of a failure raises, as rank 0 does."""
    if _flag_from_core_rank0(core, failed, chunk.device):
        raise DeliveryRejected("the lanes' sum failed on the core's rank 0 (its error names why)")
    torch_dist.broadcast(chunk, 0, group=core.group)
