"""The trainer's copy of what one engine group holds, bucket by bucket: what a delta push diffs against.

A full push that records (`Join(delta="record")`) copies every bucket it sent; a delta push
(`Join(delta="send")`) sends each bucket as `miles.utils.delta.encode_bucket(image, new)` (a header
broadcast, then a payload broadcast) and then makes the image the new bytes. The image lives beside the
weight-update group it belongs to and goes with it: a failed push, a fresh group or a restarted trainer
leaves no image, so the next push is a full one (docs/weights.md "Delta push").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from miles.engines.weight_group import GroupHandle
from miles.utils import delta
from miles.utils.buckets import TensorMeta, dtype_from_name

# off: a plain full push, no image; record: a full push that keeps what it sent; send: a delta push
DeltaMode = Literal["off", "record", "send"]


@dataclass(frozen=True)
class FlatSend:
    """What sending one flattened bucket put on the wire."""

    bytes: int  # header + payload (a full bucket: the bucket)
    dense_bytes: int  # what a full push of this bucket sends
    form: str  # "full" (no delta frame) or the delta kind: dense, sparse, bitmask, bitmask_i8
    changed: int | None  # 16-bit words that changed (a delta push only)
    encode_s: float  # diffing against the image and updating it


@dataclass
class EngineImage:
    """The bytes of each bucket of `plan` as the group's engines hold them (None: not sent yet)."""

    plan: tuple[tuple[str, ...], ...]
    metas: Mapping[str, TensorMeta]
    buckets: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = [None] * len(self.plan)

    @property
    def complete(self) -> bool:
        return all(b is not None for b in self.buckets)

    def record(self, index: int, sent: torch.Tensor) -> None:
        """Bucket `index` was sent whole: keep a copy (into the last one's memory when it fits)."""
        flat = sent.reshape(-1).view(torch.uint8)
        held = self.buckets[index]
        if held is not None and held.shape == flat.shape and held.device == flat.device:
            held.copy_(flat)
        else:
            self.buckets[index] = flat.clone()

    def encode(self, index: int, new: torch.Tensor) -> delta.BucketDelta:
        """Bucket `index` against what the engines hold; the image becomes `new` (the caller sends it)."""
        held = self.buckets[index]
        flat = new.reshape(-1).view(torch.uint8)
        if held is None or held.shape != flat.shape or held.device != flat.device:
            raise RuntimeError(f"no image of bucket {index} to diff against; the push needs a full one")
        encoded = delta.encode_bucket(held, flat)
        held.copy_(flat)
        return encoded

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor's bytes inside its bucket's image, viewed in its dtype and shape."""
        for names, held in zip(self.plan, self.buckets, strict=True):
            if held is None:
                continue
            offset = 0
            for name in names:
                meta = self.metas[name]
                view = held[offset : offset + meta.nbytes].view(dtype_from_name(meta.dtype))
                yield name, view.reshape(meta.shape)
                offset += meta.nbytes

    def digests(self) -> dict[str, str]:
        return delta.digest_many(self.tensors())


def fresh_image(
    plan: tuple[tuple[str, ...], ...], metas: Mapping[str, TensorMeta], last: EngineImage | None
) -> EngineImage:
    """An empty image of `plan` for a recording push; reuses `last`'s memory when the plan is the same."""
    if last is not None and last.plan == plan:
        return EngineImage(plan, metas, list(last.buckets))
    return EngineImage(plan, metas)


def send_flat(
    group: GroupHandle, buffer: torch.Tensor, mode: DeltaMode, image: EngineImage | None, index: int
) -> FlatSend:
    """Broadcast one flattened bucket as `mode` says; blocking. The bucket may lie on a device the group
    does not move (a GPU trainer's weights over gloo, when diffing there): what crosses goes to the host."""
    nbytes = buffer.numel() * buffer.element_size()
    wire = buffer.device if group.backend == "nccl" else torch.device("cpu")
    if mode == "send" and image is not None:
        start = time.perf_counter()
        encoded = image.encode(index, buffer)
        encode_s = time.perf_counter() - start
        group.broadcast(encoded.header.to(wire), src=0)
        group.broadcast(encoded.payload.to(wire), src=0)
        sent = encoded.nbytes + encoded.header.numel() * 8
        return FlatSend(sent, nbytes, encoded.kind, encoded.changed, encode_s)
    group.broadcast(buffer.to(wire), src=0)
    encode_s = 0.0
    if mode == "record" and image is not None:
        start = time.perf_counter()
        image.record(index, buffer)
        encode_s = time.perf_counter() - start
    return FlatSend(nbytes, nbytes, "full", None, encode_s)
