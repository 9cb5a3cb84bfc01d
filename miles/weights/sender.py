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
(docs/weights.md "Kept group"); a Join of a fresh group aborts any kept one first. With a kept group the
driver skips Describe: it plans from the tensors the group's last push sent (`Join(layout_known=True)`),
and the trainer answers StaleLayout when those are no longer its tensors.

Each step is a TrainerCommand (the driver runs it with `trainer.run(step)`) that every rank receives and
runs in its push role. With a backend whose weights lie whole on rank 0 (transformers), rank 0 is the
sender and the other ranks are idle. A tensor-parallel backend (megatron) gives a push source
(`backend.push_source()`, miles/train/megatron/push.py): the other TP ranks of its first data-parallel
replica are gatherers, which take part in each Broadcast by sending their shards of that bucket's tensors
to rank 0 before it broadcasts, so no rank ever holds more than one bucket unsharded. What outlives one
command (the sessions of pushes under way, keyed by group name, the groups kept between pushes, the last
walk of the weights) belongs to this process's RankSender. See docs/weights.md.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from miles.engines.weight_group import (
    GroupHandle,
    create_weight_update_group,
    listen_as_master,
    pick_master_port,
)
from miles.train.backends.base import PushLayoutKeyed, PushRole, PushSource, ShardedWeights, TrainBackend
from miles.train.commands import TrainerCommand
from miles.utils.buckets import TensorMeta, pack_flat
from miles.utils.packer import BucketPacker, PlanLayout, plan_layout
from miles.weights.delta_image import DeltaMode, EngineImage, FlatSend, fresh_image, send_flat

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
class StaleLayout:
    """Join's answer when the driver planned the push from the layout of the kept group's last push
    (`Join.layout_known`) and that no longer holds: the trainer kept no such group, or its tensors
    changed. Nothing was joined; the driver asks for `Describe` and joins again."""

    group_name: str
    reason: str


@dataclass(frozen=True)
class SentBucket:
    """What one Broadcast did: bytes on the wire, and where its time went on the trainer."""

    bytes: int
    pack_wait_s: float  # waiting for this bucket's packing (0 when it was packed while the last one sent)
    wire_s: float  # the broadcast call itself (a delta push: encoding included, see encode_s)
    dense_bytes: int = 0  # what a full push of this bucket sends (== bytes for a full push)
    form: str = "full"  # a delta push: the delta kind sent (dense, sparse, bitmask, bitmask_i8)
    changed: int | None = None  # a delta push: the 16-bit words that changed
    encode_s: float = 0.0  # diffing against the engines' image (or, recording, copying into it)


def _push_source(backend: TrainBackend) -> PushSource | None:
    return backend.push_source() if isinstance(backend, ShardedWeights) else None


def _role(backend: TrainBackend, source: PushSource | None) -> PushRole:
    if source is not None:
        return source.role
    rank = torch_dist.get_rank() if torch_dist.is_available() and torch_dist.is_initialized() else 0
    return "sender" if rank == 0 else "idle"


@dataclass
class _Session:
    group: GroupHandle | None  # None on a gatherer: only the sender is in the engines' group
    plan: tuple[tuple[str, ...], ...]
    tensors: dict[str, torch.Tensor] = field(repr=False)  # whole weights on the sender (no push source)
    packer: BucketPacker | None = field(default=None, repr=False)  # flattened pushes only
    buckets_sent: int = 0
    source: PushSource | None = field(default=None, repr=False)  # sharded weights: gathered per bucket
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    flattened: bool = True
    metas: tuple[TensorMeta, ...] = ()  # what this push sends, kept with the group for the next Join
    delta: DeltaMode = "off"
    image: EngineImage | None = field(default=None, repr=False)  # what the engines hold (record / send)

    def end(self) -> None:
        """The push is over; the group stays joined."""
        if self.packer is not None:
            self.packer.close()
            self.packer = None


@dataclass(frozen=True)
class Describe(TrainerCommand[SenderInfo]):
    """`listen`: open the store of a fresh group now (False when the driver means to reuse a kept one)."""

    listen: bool = True

    def run(self, backend: TrainBackend) -> SenderInfo | None:
        source = _push_source(backend)
        if _role(backend, source) != "sender":
            return None
        return RANK_SENDER.describe(backend, source, self.listen)


@dataclass(frozen=True)
class Join(TrainerCommand[int | GroupFailure | StaleLayout]):
    """Returns the number of tensors this session will send.

    `buckets` is the driver's plan (the names of each bucket, in order): knowing it, the trainer packs
    bucket k+1 while bucket k is on the wire. `flattened` sends each bucket as one packed buffer
    (SGLang's load_format="flattened_bucket"), else one broadcast per tensor. `reuse`: the group is the
    one this trainer kept from its last push (engines are already members); else a fresh group is joined.
    `layout_known` (with `reuse`): no Describe came first; the driver planned from the tensors the kept
    group's last push sent, so the trainer checks they are still its tensors and answers StaleLayout if
    not (a kept group's steady state: one trainer round trip per push instead of two).
    `delta` (flattened pushes only): "record" keeps a copy of every bucket sent, the image a later delta
    push diffs against; "send" sends each bucket as a delta against the image the group's last push left
    (docs/weights.md "Delta push"); "off" keeps no image."""

    group: GroupSpec
    buckets: tuple[tuple[str, ...], ...]
    flattened: bool = True
    reuse: bool = False
    layout_known: bool = False
    delta: DeltaMode = "off"

    def run(self, backend: TrainBackend) -> int | GroupFailure | StaleLayout | None:
        source = _push_source(backend)
        role = _role(backend, source)
        if role == "gatherer" and source is not None:
            return RANK_SENDER.join_as_gatherer(self, source)
        return RANK_SENDER.join(backend, source, self) if role == "sender" else None


@dataclass(frozen=True)
class Broadcast(TrainerCommand[SentBucket | GroupFailure]):
    """Broadcast bucket `bucket_index` of the plan given at Join."""

    group_name: str
    bucket_index: int

    def run(self, backend: TrainBackend) -> SentBucket | GroupFailure | None:
        return None if _role(backend, _push_source(backend)) == "idle" else RANK_SENDER.broadcast(self)


@dataclass(frozen=True)
class DigestImage(TrainerCommand[dict[str, str] | GroupFailure]):
    """The digest (miles.utils.delta.digest) of every tensor in the image this trainer holds of the
    group's engines, to compare with the engines' after a delta push; GroupFailure when it holds none."""

    group_name: str

    def run(self, backend: TrainBackend) -> dict[str, str] | GroupFailure | None:
        if _role(backend, _push_source(backend)) != "sender":
            return None
        return RANK_SENDER.digest_image(self.group_name)


@dataclass(frozen=True)
class Close(TrainerCommand[bool]):
    """Returns whether this process had joined the group. `keep`: the push succeeded; keep the group for
    the next one. `abort`: leave without waiting for the peers (a failed push: one may be dead)."""

    group_name: str
    keep: bool = False
    abort: bool = False

    def run(self, backend: TrainBackend) -> bool | None:
        if _role(backend, _push_source(backend)) == "idle":
            return None
        if self.keep:
            return RANK_SENDER.keep(self.group_name)
        return RANK_SENDER.close(self.group_name, abort=self.abort)


SenderCommand = Describe | Join | Broadcast | DigestImage | Close


def _local_ip() -> str:
    try:
        import ray
    except ImportError:  # a trainer process outside Ray (bench/push_nccl.py, the GPU image without Ray)
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def pushed_weights(backend: TrainBackend) -> Iterator[tuple[str, torch.Tensor]]:
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


@dataclass(frozen=True)
class _Walk:
    """One walk of a backend's pushed weights, reusable while the backend's `push_layout_key()`
    (PushLayoutKeyed) is unchanged. The walk (a state_dict of every tensor) was most of a kept-group
    push's preparation."""

    backend: weakref.ref[Any]
    key: Hashable
    weights: tuple[tuple[str, torch.Tensor], ...]
    metas: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class _Prepared:
    """The last push's tensors on the sending device and its plan's layout, for a push with the same walk
    (the same object: RankSender.walk reuses it while the layout key holds) and plan."""

    weights: tuple[tuple[str, torch.Tensor], ...]
    key: tuple[tuple[tuple[str, ...], ...], torch.device, bool]  # plan, device, flattened
    tensors: dict[str, torch.Tensor]
    layout: PlanLayout | None


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as sent from `device`, detached (as it already is, on it, in the usual case: no call)."""
    return tensor if tensor.device == device and not tensor.requires_grad else tensor.detach().to(device)


def _check_plan(plan: tuple[tuple[str, ...], ...], names: Collection[str]) -> None:
    unknown = sorted({n for bucket in plan for n in bucket} - set(names))
    if unknown:  # a plan from another model's Describe: a driver bug, not the engines' fault
        raise ValueError(f"the bucket plan names tensors this trainer does not have: {unknown[:5]}")


def _gather_bucket(session: _Session, index: int) -> tuple[list[torch.Tensor], float] | None:
    """(the bucket's tensors on the sender's device, seconds) from the push source; None without one."""
    if session.source is None:
        return None
    start = time.perf_counter()
    tensors = session.source.gather_bucket(session.plan[index]) or []
    return [t.to(session.device) for t in tensors], time.perf_counter() - start


def _sent(flat: FlatSend, pack_wait_s: float, wire_s: float) -> SentBucket:
    return SentBucket(
        flat.bytes, pack_wait_s, wire_s, flat.dense_bytes, flat.form, flat.changed, flat.encode_s
    )


def _send_flat(session: _Session, index: int, buffer: torch.Tensor) -> FlatSend:
    assert session.group is not None
    return send_flat(session.group, buffer, session.delta, session.image, index)


def _send_gathered(session: _Session, index: int, tensors: list[torch.Tensor], waited: float) -> SentBucket:
    start = time.perf_counter()
    if session.flattened:
        metas = [TensorMeta.of(n, t) for n, t in zip(session.plan[index], tensors, strict=True)]
        buffer = pack_flat(tensors, metas)
        packed = time.perf_counter()
        flat = _send_flat(session, index, buffer)
        return _sent(flat, waited + packed - start, time.perf_counter() - packed)
    for work in [session.group.broadcast_async(t, src=0) for t in tensors]:
        work.wait()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return SentBucket(nbytes, pack_wait_s=waited, wire_s=time.perf_counter() - start, dense_bytes=nbytes)


def _send_bucket(
    session: _Session, index: int, gathered: tuple[list[torch.Tensor], float] | None
) -> SentBucket:
    if gathered is not None:
        return _send_gathered(session, index, *gathered)
    start = time.perf_counter()
    if session.packer is not None:
        buffer = session.packer.take(index)
        packed = time.perf_counter()
        flat = _send_flat(session, index, buffer)
        session.packer.sent(index)
        return _sent(flat, packed - start, time.perf_counter() - packed)
    tensors = [session.tensors[name].contiguous() for name in session.plan[index]]
    packed = time.perf_counter()
    for work in [session.group.broadcast_async(t, src=0) for t in tensors]:
        work.wait()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return SentBucket(nbytes, packed - start, time.perf_counter() - packed, dense_bytes=nbytes)


class RankSender:
    """This trainer process's side of the weight push: the sessions of pushes under way (by group name),
    the groups kept between pushes with the tensors their last push sent, the store a Describe opened for
    the Join that follows, and the last walk of the weights. One per trainer process (RANK_SENDER): the
    commands arrive by pickle carrying only their arguments, and the groups they name live as long as the
    process does."""

    def __init__(self) -> None:
        # A group lives in `_sessions` while a push uses it and in `_kept` between pushes, never in both.
        self._sessions: dict[str, _Session] = {}
        self._kept: dict[str, GroupHandle] = {}
        self._kept_layouts: dict[str, tuple[TensorMeta, ...]] = {}  # kept group -> its last push's tensors
        self._listening: dict[int, Any] = {}  # master port -> rank 0's TCPStore, opened by Describe
        self._last_walk: _Walk | None = None
        self._last_prepared: _Prepared | None = None
        # kept group -> what its engines hold, for a delta push (a push under way holds it in its session)
        self._images: dict[str, EngineImage] = {}

    def open_sessions(self) -> list[str]:
        return sorted(self._sessions)

    def kept_groups(self) -> list[str]:
        return sorted(self._kept)

    # ---- the commands' work -------------------------------------------------------------------------

    def describe(self, backend: TrainBackend, source: PushSource | None, listen: bool) -> SenderInfo:
        metas = source.metas() if source is not None else list(self.walk(backend)[1])
        if not metas:
            raise RuntimeError("the trainer has no weights to push (iter_hf_weights yielded nothing)")
        address, port = _local_ip(), pick_master_port()
        # The group's store listens from now on, so engines joining find it at once (a member that connects
        # first backs off ~0.5 s). One push at a time: an earlier Describe's store was never joined.
        self._listening.clear()
        if listen:
            self._listening[port] = listen_as_master(address, port)
        kept = next(iter(self._kept), None)
        return SenderInfo(master_address=address, master_port=port, tensors=metas, kept_group=kept)

    def join_as_gatherer(self, cmd: Join, source: PushSource) -> int:
        """A gatherer is in no group with the engines: it records the plan, to gather its part of each
        bucket."""
        _check_plan(cmd.buckets, {meta.name for meta in source.metas()})
        if not cmd.reuse:
            self._close_all()
        self._sessions.pop(cmd.group.group_name, None)
        self._sessions[cmd.group.group_name] = _Session(
            group=None, plan=cmd.buckets, tensors={}, source=source
        )
        return sum(len(bucket) for bucket in cmd.buckets)

    def join(
        self, backend: TrainBackend, source: PushSource | None, cmd: Join
    ) -> int | GroupFailure | StaleLayout:
        spec = cmd.group
        kept = self._kept.get(spec.group_name)
        if cmd.layout_known and kept is None:
            return StaleLayout(spec.group_name, "this trainer kept no such group")
        if cmd.reuse and (kept is None or (kept.world_size, kept.backend) != (spec.world_size, spec.backend)):
            return GroupFailure(
                spec.group_name, "this trainer kept no such group; the push needs a fresh one"
            )
        on_gpu = spec.backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        pushed, metas = ((), tuple(source.metas())) if source is not None else self.walk(backend)
        if cmd.delta != "off" and pushed:  # diff where the weights are: only the payload crosses to the host
            device = pushed[0][1].device
        if cmd.layout_known and self._kept_layouts.get(spec.group_name) != metas:
            return StaleLayout(spec.group_name, "the trainer's tensors changed since the group's last push")
        image = self._image_for(cmd, metas)
        if isinstance(image, GroupFailure):
            return image
        if not cmd.reuse:
            self._close_all()
        if source is not None:  # gathered bucket by bucket at Broadcast, with the gatherers
            _check_plan(cmd.buckets, {meta.name for meta in metas})
            return self._open_session(spec, cmd, {}, None, source, device, metas, image)
        tensors, layout = self._prepared(pushed, cmd.buckets, device, cmd.flattened)
        # Bucket 0 packs while the group forms: joining waits for every engine anyway.
        packer = BucketPacker(tensors, cmd.buckets, device, layout) if layout is not None else None
        return self._open_session(spec, cmd, tensors, packer, None, device, metas, image)

    def broadcast(self, cmd: Broadcast) -> SentBucket | GroupFailure | None:
        session = self._sessions.get(cmd.group_name)
        if session is None:
            return GroupFailure(
                cmd.group_name, "no such weight-update group on this trainer; send Join first"
            )
        if cmd.bucket_index != session.buckets_sent or cmd.bucket_index >= len(session.plan):
            self.close(cmd.group_name, abort=True)
            return GroupFailure(
                cmd.group_name,
                f"bucket {cmd.bucket_index} requested but {session.buckets_sent} of {len(session.plan)} were "
                "sent; buckets go in order",
            )
        try:  # a gather that fails is the trainer's failure (a TP peer), not the engines': it raises
            gathered = _gather_bucket(session, cmd.bucket_index)
        except BaseException:
            self.close(cmd.group_name, abort=True)
            raise
        if session.group is None:  # a gatherer: its shards went to the sender
            session.buckets_sent += 1
            return None
        try:
            sent = _send_bucket(session, cmd.bucket_index, gathered)
        except RuntimeError as exc:
            self.close(cmd.group_name, abort=True)  # engines blocked in this bucket's receive see us leave
            return GroupFailure(cmd.group_name, f"broadcast of bucket {cmd.bucket_index} failed: {exc}")
        except BaseException:
            self.close(cmd.group_name, abort=True)
            raise
        session.buckets_sent += 1
        return sent

    def digest_image(self, group_name: str) -> dict[str, str] | GroupFailure:
        session = self._sessions.get(group_name)
        image = session.image if session is not None else self._images.get(group_name)
        if image is None or not image.complete:
            return GroupFailure(group_name, "this trainer holds no complete image of the group's engines")
        return image.digests()

    def keep(self, group_name: str) -> bool:
        """End the push of this group but stay joined, for the next push; True when there was a session."""
        session = self._sessions.pop(group_name, None)
        if session is None:
            return False
        session.end()
        if session.group is not None:  # a gatherer keeps nothing
            self._kept[group_name] = session.group
            self._kept_layouts[group_name] = session.metas
            if session.image is not None and session.image.complete:
                self._images[group_name] = session.image
        return True

    def close(self, group_name: str, *, abort: bool = False) -> bool:
        """Leave the group (in a push or kept) if this process joined it; True when there was one.
        `abort` leaves without waiting for the peers (GroupHandle.abort)."""
        session = self._sessions.pop(group_name, None)
        group = session.group if session is not None else self._kept.pop(group_name, None)
        self._kept_layouts.pop(group_name, None)
        self._images.pop(group_name, None)  # a group left (or a failed push): its image says nothing
        if session is not None:
            session.end()
        if group is None:  # no such group here, or a gatherer's session (it joined no group)
            return session is not None
        group.abort() if abort else group.destroy()
        return True

    # ---- inside -------------------------------------------------------------------------------------

    def _close_all(self) -> None:
        """A Join of a fresh group: a kept group of other members, or a stale session of an aborted push."""
        for name in [*self._kept, *self._sessions]:
            self.close(name, abort=True)

    def _image_for(self, cmd: Join, metas: tuple[TensorMeta, ...]) -> EngineImage | GroupFailure | None:
        """The image this push records into or diffs against (None: it keeps none)."""
        name = cmd.group.group_name
        last = self._images.get(name)
        if cmd.delta == "off":
            return None
        if not cmd.flattened:
            raise ValueError("a delta push needs flattened buckets (PushConfig.flattened)")
        if cmd.delta == "record":
            return fresh_image(cmd.buckets, {meta.name: meta for meta in metas}, last)
        if not cmd.reuse or last is None or last.plan != cmd.buckets or not last.complete:
            return GroupFailure(name, "no image of what the group's engines hold for this plan; push in full")
        return last

    def _open_session(
        self,
        spec: GroupSpec,
        cmd: Join,
        tensors: dict[str, torch.Tensor],
        packer: BucketPacker | None,
        source: PushSource | None,
        device: torch.device,
        metas: tuple[TensorMeta, ...],
        image: EngineImage | None,
    ) -> int | GroupFailure:
        try:
            self._kept_layouts.pop(spec.group_name, None)
            self._images.pop(spec.group_name, None)  # the session holds it from now on
            group = self._kept.pop(spec.group_name) if cmd.reuse else self._create(spec)
        except BaseException as exc:
            if packer is not None:
                packer.close()
            # torch's DistError/DistNetworkError/store timeouts derive from RuntimeError
            if isinstance(exc, RuntimeError):
                return GroupFailure(spec.group_name, f"joining the weight-update group failed: {exc}")
            raise
        self._sessions[spec.group_name] = _Session(
            group,
            cmd.buckets,
            tensors,
            packer,
            source=source,
            device=device,
            flattened=cmd.flattened,
            metas=metas,
            delta=cmd.delta,
            image=image,
        )
        logger.info(
            "weight sender %s group %s (world size %d)",
            "reuses" if cmd.reuse else "joined",
            spec.group_name,
            spec.world_size,
        )
        return sum(len(bucket) for bucket in cmd.buckets) if source is not None else len(tensors)

    def _create(self, spec: GroupSpec) -> GroupHandle:
        return create_weight_update_group(
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank=0,
            world_size=spec.world_size,
            backend=spec.backend,
            group_name=spec.group_name,
            timeout_s=spec.timeout_s,
            store=self._listening.pop(spec.master_port, None),
        )

    def walk(
        self, backend: TrainBackend
    ) -> tuple[tuple[tuple[str, torch.Tensor], ...], tuple[TensorMeta, ...]]:
        """(name, tensor) of every pushed weight and their metas; from the last walk while it holds (the
        same tuple: the colocated push's plan, miles.weights.ipc_sender, is kept while it is)."""
        key = backend.push_layout_key() if isinstance(backend, PushLayoutKeyed) else None
        last = self._last_walk
        if key is not None and last is not None and last.backend() is backend and last.key == key:
            return last.weights, last.metas
        weights = tuple(pushed_weights(backend))
        metas = tuple(TensorMeta.of(name, tensor) for name, tensor in weights)
        self._last_walk = _Walk(weakref.ref(backend), key, weights, metas) if key is not None else None
        return weights, metas

    def _prepared(
        self,
        weights: tuple[tuple[str, torch.Tensor], ...],
        plan: tuple[tuple[str, ...], ...],
        device: torch.device,
        flattened: bool,
    ) -> tuple[dict[str, torch.Tensor], PlanLayout | None]:
        """The tensors by name on `device` and, for a flattened push, the plan's layout; from the last push
        while its walk and plan are this one's. Kept only when the walk is `walk`'s reusable one (its
        weights lie where they did) and no tensor had to be copied to `device` (a copy would go stale)."""
        last = self._last_prepared
        if last is not None and last.weights is weights and last.key == (plan, device, flattened):
            return last.tensors, last.layout
        tensors = {name: _on(device, t) for name, t in weights}
        _check_plan(plan, tensors.keys())
        layout = plan_layout(tensors, plan) if flattened and plan else None
        reusable = self._last_walk is not None and self._last_walk.weights is weights
        if reusable and all(tensors[name] is t for name, t in weights):
            self._last_prepared = _Prepared(weights, (plan, device, flattened), tensors, layout)
        else:
            self._last_prepared = None
        return tensors, layout


RANK_SENDER = RankSender()


def open_sessions() -> list[str]:
    """The groups this process is pushing to now (RANK_SENDER's)."""
    return RANK_SENDER.open_sessions()


def kept_groups() -> list[str]:
    """The groups this process kept for its next push (RANK_SENDER's)."""
    return RANK_SENDER.kept_groups()
