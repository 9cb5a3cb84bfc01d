"""Trainer side of the weight push: runs on trainer rank 0, one command per actor call.

The driver (miles.weights.push) drives the push one step at a time, so it can pair every broadcast with
the engines' HTTP calls for the same bucket:

    Describe  -> SenderInfo(master address, a free port, the HF tensor list)
    Join      -> join the named weight-update group as rank 0 (blocks until every engine joined), take
                 the driver's bucket plan, and start packing bucket 0
    Broadcast -> broadcast bucket k of the plan (in order); bucket k+1 is packed meanwhile
    Close     -> end the push: keep the group for the next push (`keep`), or leave it (also done by
                 any failing Broadcast, so engines blocked in a receive see the peer go away instead of
                 waiting for the group timeout; `abort` leaves without waiting for the peers)

A kept group is reused by the next push's `Join(reuse=True)` while the driver sees the same members
(docs/weights.md "Kept group"); a Join of a fresh group aborts any kept one first.

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
    kept_group: str | None = None  # the group this trainer kept from its last push, if any


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

    def end(self) -> None:
        """The push is over; the group stays joined."""
        if self.packer is not None:
            self.packer.close()
            self.packer = None


# A group lives in `_sessions` while a push uses it and in `_kept` between pushes, never in both.
_sessions: dict[str, _Session] = {}
_kept: dict[str, GroupHandle] = {}
_listening: dict[int, Any] = {}  # master port -> rank 0's TCPStore, opened by Describe, taken by Join


@dataclass(frozen=True)
class Describe(TrainerCommand[SenderInfo]):
    """`listen`: open the store of a fresh group now (False when the driver means to reuse a kept one)."""

    rank0_only: ClassVar[bool] = True
    listen: bool = True

    def run(self, backend: TrainBackend) -> SenderInfo:
        return _describe(backend, self.listen)


@dataclass(frozen=True)
class Join(TrainerCommand[int | GroupFailure]):
    """Returns the number of tensors this session will send.

    `buckets` is the driver's plan (the names of each bucket, in order): knowing it, the trainer packs
    bucket k+1 while bucket k is on the wire. `flattened` sends each bucket as one packed buffer
    (SGLang's load_format="flattened_bucket"), else one broadcast per tensor. `reuse`: the group is the
    one this trainer kept from its last push (engines are already members); else a fresh group is joined."""

    rank0_only: ClassVar[bool] = True
    group: GroupSpec
    buckets: tuple[tuple[str, ...], ...]
    flattened: bool = True
    reuse: bool = False

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
    """Returns whether this process had joined the group. `keep`: the push succeeded; keep the group for
    the next one. `abort`: leave without waiting for the peers (a failed push: one may be dead)."""

    rank0_only: ClassVar[bool] = True
    group_name: str
    keep: bool = False
    abort: bool = False

    def run(self, backend: TrainBackend) -> bool:
        if self.keep:
            return keep_session(self.group_name)
        return close_session(self.group_name, abort=self.abort)


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


def _describe(backend: TrainBackend, listen: bool) -> SenderInfo:
    metas = [TensorMeta.of(name, tensor) for name, tensor in _pushed_weights(backend)]
    if not metas:
        raise RuntimeError("the trainer has no weights to push (iter_hf_weights yielded nothing)")
    address, port = _local_ip(), pick_master_port()
    # The group's store listens from now on, so engines joining find it at once (a member that connects
    # first backs off ~0.5 s). One push at a time: an earlier Describe's store was never joined.
    _listening.clear()
    if listen:
        _listening[port] = listen_as_master(address, port)
    kept = next(iter(_kept), None)
    return SenderInfo(master_address=address, master_port=port, tensors=metas, kept_group=kept)


def _join(backend: TrainBackend, cmd: Join) -> int | GroupFailure:
    spec = cmd.group
    kept = _kept.get(spec.group_name)
    if cmd.reuse and (kept is None or (kept.world_size, kept.backend) != (spec.world_size, spec.backend)):
        return GroupFailure(spec.group_name, "this trainer kept no such group; the push needs a fresh one")
    if not cmd.reuse:  # a kept group of other members, or a stale session of an aborted push
        for name in [*_kept, *_sessions]:
            close_session(name, abort=True)
    on_gpu = spec.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tensors = {name: t.detach().to(device) for name, t in _pushed_weights(backend)}
    unknown = sorted({n for bucket in cmd.buckets for n in bucket} - tensors.keys())
    if unknown:  # a plan from another model's Describe: a driver bug, not the engines' fault
        raise ValueError(f"the bucket plan names tensors this trainer does not have: {unknown[:5]}")
    # Bucket 0 packs while the group forms: joining waits for every engine anyway.
    packer = BucketPacker(tensors, cmd.buckets, device) if cmd.flattened and cmd.buckets else None
    try:
        group = _kept.pop(spec.group_name) if cmd.reuse else _create(spec)
    except BaseException as exc:
        if packer is not None:
            packer.close()
        if isinstance(exc, RuntimeError):  # torch's DistError/DistNetworkError/store timeouts derive from it
            return GroupFailure(spec.group_name, f"joining the weight-update group failed: {exc}")
        raise
    _sessions[spec.group_name] = _Session(group=group, plan=cmd.buckets, tensors=tensors, packer=packer)
    logger.info(
        "weight sender %s group %s (world size %d)",
        "reuses" if cmd.reuse else "joined",
        spec.group_name,
        spec.world_size,
    )
    return len(tensors)


def _create(spec: GroupSpec) -> GroupHandle:
    return create_weight_update_group(
        master_address=spec.master_address,
        master_port=spec.master_port,
        rank=0,
        world_size=spec.world_size,
        backend=spec.backend,
        group_name=spec.group_name,
        timeout_s=spec.timeout_s,
        store=_listening.pop(spec.master_port, None),
    )


def _broadcast(cmd: Broadcast) -> SentBucket | GroupFailure:
    session = _sessions.get(cmd.group_name)
    if session is None:
        return GroupFailure(cmd.group_name, "no such weight-update group on this trainer; send Join first")
    if cmd.bucket_index != session.buckets_sent or cmd.bucket_index >= len(session.plan):
        close_session(cmd.group_name, abort=True)
        return GroupFailure(
            cmd.group_name,
            f"bucket {cmd.bucket_index} requested but {session.buckets_sent} of {len(session.plan)} were "
            "sent; buckets go in order",
        )
    try:
        sent = _send_bucket(session, cmd.bucket_index)
    except RuntimeError as exc:
        close_session(cmd.group_name, abort=True)  # engines blocked in this bucket's receive see us leave
        return GroupFailure(cmd.group_name, f"broadcast of bucket {cmd.bucket_index} failed: {exc}")
    except BaseException:
        close_session(cmd.group_name, abort=True)
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


def keep_session(group_name: str) -> bool:
    """End the push of this group but stay joined, for the next push; True when there was a session."""
    session = _sessions.pop(group_name, None)
    if session is None:
        return False
    session.end()
    _kept[group_name] = session.group
    return True


def close_session(group_name: str, *, abort: bool = False) -> bool:
    """Leave the group (in a push or kept) if this process joined it; True when there was one.
    `abort` leaves without waiting for the peers (GroupHandle.abort)."""
    session = _sessions.pop(group_name, None)
    group = session.group if session is not None else _kept.pop(group_name, None)
    if group is None:
        return False
    if session is not None:
        session.end()
    group.abort() if abort else group.destroy()
    return True


def open_sessions() -> list[str]:
    return sorted(_sessions)


def kept_groups() -> list[str]:
    return sorted(_kept)
