"""Trainer side of the weight push: runs on trainer rank 0, one command per actor call.

The driver (miles.weights.push) drives the push one step at a time, so it can pair every broadcast with
the engines' HTTP calls for the same bucket:

    Describe  -> SenderInfo(master address, a free port, the HF tensor list)
    Join      -> join the named weight-update group as rank 0 (blocks until every engine joined), take
                 the driver's bucket plan, and start packing bucket 0
    Broadcast -> broadcast bucket k of the plan (in order); bucket k+1 is packed meanwhile
    Close     -> leave the group (also done by any failing Broadcast, so engines blocked in a receive
                 see the peer go away instead of waiting for the group timeout)

Each step is a TrainerCommand for rank 0 alone (the driver runs it with `trainer.run(step)`). Sessions
live in this process (the trainer actor) keyed by group name. See docs/weights.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from miles.engines.weight_group import (
    GroupHandle,
    create_weight_update_group,
    listen_as_master,
    pick_master_port,
)
from miles.train.backends.base import TrainBackend
from miles.train.commands import TrainerCommand
from miles.weights.buckets import TensorMeta
from miles.weights.packer import BucketPacker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupSpec:
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass(frozen=True)
class SenderInfo:
    master_address: str
    master_port: int
    tensors: list[TensorMeta]


@dataclass(frozen=True)
class GroupFailure:
    """Returned, not raised, when the weight-update group fails (a peer left, a join timed out).

    Such a failure is the engines' or the network's, not the trainer's: raising would mark the trainer
    cell errored and end the job. The driver turns it into WeightPushError and aborts the push.
    """

    group_name: str
    message: str


@dataclass(frozen=True)
class SentBucket:
    """What one Broadcast did: bytes on the wire, and where its time went on the trainer."""

    bytes: int
    pack_wait_s: float  # waiting for this bucket's packing (0 when it was packed while the last one sent)
    wire_s: float  # the broadcast call itself


@dataclass
class _Session:
    group: GroupHandle
    plan: tuple[tuple[str, ...], ...]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    packer: BucketPacker | None = field(default=None, repr=False)  # flattened pushes only
    buckets_sent: int = 0

    def close(self) -> None:
        if self.packer is not None:
            self.packer.close()
        self.group.destroy()


_sessions: dict[str, _Session] = {}
_listening: dict[int, Any] = {}  # master port -> rank 0's TCPStore, opened by Describe, taken by Join


@dataclass(frozen=True)
class Describe(TrainerCommand[SenderInfo]):
    rank0_only: ClassVar[bool] = True

    def run(self, backend: TrainBackend) -> SenderInfo:
        return _describe(backend)


@dataclass(frozen=True)
class Join(TrainerCommand[int | GroupFailure]):
    """Returns the number of tensors this session will send.

    `buckets` is the driver's plan (the names of each bucket, in order): knowing it, the trainer packs
    bucket k+1 while bucket k is on the wire. `flattened` sends each bucket as one packed buffer
    (SGLang's load_format="flattened_bucket"), else one broadcast per tensor."""

    rank0_only: ClassVar[bool] = True
    group: GroupSpec
    buckets: tuple[tuple[str, ...], ...]
    flattened: bool = True

    def run(self, backend: TrainBackend) -> int | GroupFailure:
        return _join(backend, self)


@dataclass(frozen=True)
class Broadcast(TrainerCommand[SentBucket | GroupFailure]):
    """Broadcast bucket `bucket_index` of the plan given at Join."""

    rank0_only: ClassVar[bool] = True
    group_name: str
    bucket_index: int

    def run(self, backend: TrainBackend) -> SentBucket | GroupFailure:
        return _broadcast(self)


@dataclass(frozen=True)
class Close(TrainerCommand[bool]):
    """Returns whether this process had joined the group."""

    rank0_only: ClassVar[bool] = True
    group_name: str

    def run(self, backend: TrainBackend) -> bool:
        return close_session(self.group_name)


SenderCommand = Describe | Join | Broadcast | Close


def _local_ip() -> str:
    try:
        import ray
    except ImportError:  # a trainer process outside Ray (bench/push_nccl.py, the GPU image without Ray)
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _pushed_weights(backend: TrainBackend) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights in HF names, each piece of memory once. A tied weight (`lm_head.weight`
    sharing the embedding's memory) comes back under a second name; engines built from the same config
    tie it the same way (SGLang skips `lm_head.weight` when tied), so sending it again costs bytes only
    (21% of a Qwen3-0.6B push)."""
    seen: set[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in backend.iter_hf_weights():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor


def _describe(backend: TrainBackend) -> SenderInfo:
    metas = [TensorMeta.of(name, tensor) for name, tensor in _pushed_weights(backend)]
    if not metas:
        raise RuntimeError("the trainer has no weights to push (iter_hf_weights yielded nothing)")
    address, port = _local_ip(), pick_master_port()
    # The group's store listens from now on, so engines joining find it at once (a member that connects
    # first backs off ~0.5 s). One push at a time: an earlier Describe's store was never joined.
    _listening.clear()
    _listening[port] = listen_as_master(address, port)
    return SenderInfo(master_address=address, master_port=port, tensors=metas)


def _join(backend: TrainBackend, cmd: Join) -> int | GroupFailure:
    spec = cmd.group
    close_session(spec.group_name)  # a stale session of the same name belongs to an aborted push
    on_gpu = spec.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tensors = {name: t.detach().to(device) for name, t in _pushed_weights(backend)}
    unknown = sorted({n for bucket in cmd.buckets for n in bucket} - tensors.keys())
    if unknown:  # a plan from another model's Describe: a driver bug, not the engines' fault
        raise ValueError(f"the bucket plan names tensors this trainer does not have: {unknown[:5]}")
    # Bucket 0 packs while the group forms: joining waits for every engine anyway.
    packer = BucketPacker(tensors, cmd.buckets, device) if cmd.flattened and cmd.buckets else None
    try:
        group = create_weight_update_group(
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=0,
            world_size=spec.world_size,
            backend=spec.backend,
            group_name=spec.group_name,
            timeout_s=spec.timeout_s,
            store=_listening.pop(spec.master_port, None),
        )
    except BaseException as exc:
        if packer is not None:
            packer.close()
        if isinstance(exc, RuntimeError):  # torch's DistError/DistNetworkError/store timeouts derive from it
            return GroupFailure(spec.group_name, f"joining the weight-update group failed: {exc}")
        raise
    _sessions[spec.group_name] = _Session(group=group, plan=cmd.buckets, tensors=tensors, packer=packer)
    logger.info("weight sender joined group %s (world size %d)", spec.group_name, spec.world_size)
    return len(tensors)


def _broadcast(cmd: Broadcast) -> SentBucket | GroupFailure:
    session = _sessions.get(cmd.group_name)
    if session is None:
        return GroupFailure(cmd.group_name, "no such weight-update group on this trainer; send Join first")
    if cmd.bucket_index != session.buckets_sent or cmd.bucket_index >= len(session.plan):
        close_session(cmd.group_name)
        return GroupFailure(
            cmd.group_name,
            f"bucket {cmd.bucket_index} requested but {session.buckets_sent} of {len(session.plan)} were "
            "sent; buckets go in order",
        )
    try:
        sent = _send_bucket(session, cmd.bucket_index)
    except RuntimeError as exc:
        close_session(cmd.group_name)  # engines blocked in this bucket's receive see the peer leave
        return GroupFailure(cmd.group_name, f"broadcast of bucket {cmd.bucket_index} failed: {exc}")
    except BaseException:
        close_session(cmd.group_name)
        raise
    session.buckets_sent += 1
    return sent


def _send_bucket(session: _Session, index: int) -> SentBucket:
    start = time.perf_counter()
    if session.packer is not None:
        buffer = session.packer.take(index)
        packed = time.perf_counter()
        session.group.broadcast(buffer, src=0)
        session.packer.sent(index)
        nbytes = buffer.numel()
    else:
        tensors = [session.tensors[name].contiguous() for name in session.plan[index]]
        packed = time.perf_counter()
        for work in [session.group.broadcast_async(t, src=0) for t in tensors]:
            work.wait()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return SentBucket(bytes=nbytes, pack_wait_s=packed - start, wire_s=time.perf_counter() - packed)


def close_session(group_name: str) -> bool:
    """Leave the group if this process joined it; True when there was one."""
    session = _sessions.pop(group_name, None)
    if session is None:
        return False
    session.close()
    return True


def open_sessions() -> list[str]:
    return sorted(_sessions)
