"""Weight deltas between two bf16 images: encode what changed, apply it in place, prove it with a digest.

Why: after one optimizer step at RL learning rates only a few percent of the bf16 values an engine holds
change (the trainer steps fp32 master weights; the bf16 copy moves only where rounding flips), yet the
full push sends every byte. A delta push (issue 36) keeps, per engine group, the bf16 image the engines
hold and sends per bucket only what changed, in the smallest of these forms:

  dense       the new tensor itself                            numel * 2 bytes
  sparse      int32 flat indices of changed elements + values  changed * (4 + 2) bytes
  bitmask     packed "changed" bits (numel / 8) + values       ceil(numel / 8) + changed * 2 bytes
  bitmask_i8  packed "changed" bits + one int8 step each       ceil(numel / 8) + changed + escapes * 2
              + the new bits of the escaped elements
  xor_zlib    old XOR new as int16, zlib level 1 (host only)   measured; not chosen by `choose`

bitmask_i8 exists because most changed values move by a few units in the last place: their int16 bit
patterns differ by a small step (new - old, int16 wrapping), which fits an int8. A step outside
[-127, 127] is written as the escape -128 and that element's new bits follow in `escapes`, in order.

`choose` compares exact byte counts. Those of dense, sparse and bitmask depend only on numel and the
number of changed elements; bitmask_i8's also on the escapes, so they are counted only when bitmask_i8
could win with none (`choose_kind`). One encoding is materialised. Values are compared and written as
their int16 bits, so the result is bit-exact (NaN payloads and -0.0 included).

The bucket codec (`encode_bucket` / `payload_nbytes` / `apply_bucket`) is the same choice on a whole
flattened bucket (uint8, several tensors back to back, read as int16 words), packed into one contiguous
payload with 8-byte aligned sections, described by an int64 header of HEADER_WORDS. The receiver checks
every structural property it can (sizes, index range, mask popcount, escape count) before it writes.

`digest` is a 64-bit checksum of any tensor's bytes both sides compute on their own device after a
delta push to prove the engine holds exactly the trainer's image (`digest_many`: per tensor, as hex).
It reads the bytes as int64 words, a block of rows at a time through small scratch buffers, so it takes
any dtype and runs near memory speed (about 4.5 GB/s on 2 CPU cores).

Pure torch, device-agnostic, no I/O: the wire protocol that carries these payloads is elsewhere.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Kind = Literal["dense", "sparse", "bitmask", "bitmask_i8", "xor_zlib"]
KINDS: tuple[Kind, ...] = ("dense", "sparse", "bitmask", "bitmask_i8", "xor_zlib")
# the forms `choose` compares; on equal bytes the earlier wins (dense needs no work on either side, and
# bitmask_i8 ties bitmask only when half its changes escape: either is as good)
CHOSEN_KINDS: tuple[Kind, ...] = ("dense", "bitmask_i8", "bitmask", "sparse")
INDEX_BYTES = 4  # int32 flat indices
_MAX_INT32_INDEX = 2**31 - 1
_GATHER = 0x0102040810204080  # sum of 2^(56 - 7i), i = 0..7: see pack_bits
_ZLIB_LEVEL = 1
_STEP_MAX = 127  # a bitmask_i8 step in [-127, 127] is sent as is
_ESCAPE = -128  # the int8 that says "this element's new bits are the next entry of `escapes`"


@dataclass(frozen=True)
class EncodedDelta:
    """What goes on the wire for one tensor, and what `apply` needs to rebuild `new` from `old`.

    `values` are the new values (dense: all of them, in row-major order; sparse and bitmask: of the
    changed elements, in increasing flat index). `indices` (sparse, int32), `mask` (bitmask and
    bitmask_i8, packed uint8), `diffs` and `escapes` (bitmask_i8: int8 steps, int16 escaped new bits) and
    `blob` (xor_zlib) are set only for their kind. `nbytes` is the payload's size on the wire.
    """

    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    changed: int | None = None  # elements that differ (None: dense from `encode_dense`, not counted)
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    blob: bytes | None = None
    diffs: torch.Tensor | None = None
    escapes: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def sections(
    kind: Kind, numel: int, changed: int, itemsize: int = 2, escapes: int = 0
) -> list[tuple[str, int]]:
    """(name, bytes) of each part of `kind`'s payload, in order, for `numel` elements of which `changed`
    differ (`escapes` of them by a step bitmask_i8 cannot carry in an int8): the one byte formula."""
    if kind == "dense":
        return [("values", numel * itemsize)]
    if kind == "sparse":
        return [("indices", INDEX_BYTES * changed), ("values", itemsize * changed)]
    if kind == "bitmask":
        return [("mask", (numel + 7) // 8), ("values", itemsize * changed)]
    if kind == "bitmask_i8":
        return [("mask", (numel + 7) // 8), ("diffs", changed), ("escapes", itemsize * escapes)]
    raise ValueError(f"{kind!r} has no byte formula (it is measured): use one of {CHOSEN_KINDS}")


def wire_bytes(kind: Kind, numel: int, changed: int, itemsize: int = 2, escapes: int = 0) -> int:
    """Exact payload bytes of `kind` for a tensor (a bucket's sections add alignment: `_layout`)."""
    return sum(size for _, size in sections(kind, numel, changed, itemsize, escapes))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw 16-bit patterns, same shape and strides (a view: writes go through)."""
    if tensor.element_size() != 2 or not tensor.is_floating_point():
        raise ValueError(f"deltas need a 2-byte float dtype (bfloat16, float16), got {tensor.dtype}")
    return tensor.view(torch.int16)


def _flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    return _bits(tensor).reshape(-1)  # a copy only when the tensor is not contiguous


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"old and new differ: {tuple(old.shape)} {old.dtype} vs {tuple(new.shape)} {new.dtype}"
        )
    if old.device != new.device:
        raise ValueError(f"old and new are on different devices: {old.device} vs {new.device}")
    _bits(old)


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat bool tensor: True where the bits of `new` differ from those of `old`."""
    _check_pair(old, new)
    return _flat_bits(old) != _flat_bits(new)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8 of ceil(n / 8) bytes; element 8 * j + i is bit i of byte j.

    Eight bools (bytes 0/1) read as one little-endian int64 x; x * _GATHER puts byte i's bit at bit 56 + i
    with no carries (every partial product lands on its own bit), so the top byte is the packed byte
    (the cast to uint8 keeps the low byte of the shifted word, whatever the arithmetic shift brought in).
    """
    flat = mask.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad or flat.storage_offset() % 8:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64) * _GATHER
    return words.bitwise_right_shift_(56).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of `pack_bits`: the first `numel` bits as a flat bool tensor.

    Shifting and masking in place leaves bytes that are exactly 0 or 1, which are valid bools: one pass
    fewer than comparing with zero."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts).bitwise_and_(1)
    return bits.view(torch.bool).view(-1)[:numel]


# --- the changed elements, gathered once for every form --------------------------------------------


@dataclass(frozen=True)
class _Changes:
    """The changed elements of a flat int16 pair: where they are, their new bits and (for bitmask_i8)
    their steps new - old, int16 wrapping, with the ones an int8 cannot carry marked."""

    mask: torch.Tensor  # flat bool over all elements
    index: torch.Tensor  # int64 flat indices of the changed elements, increasing
    values: torch.Tensor  # their new bits, int16
    steps: torch.Tensor | None = None  # int16
    escaped: torch.Tensor | None = None  # bool over the changed elements

    @property
    def changed(self) -> int:
        return self.index.numel()

    def escape_count(self) -> int:
        return 0 if self.escaped is None else int(self.escaped.count_nonzero())

    def diffs(self) -> torch.Tensor:
        """One int8 per changed element: its step, or the escape."""
        assert self.steps is not None and self.escaped is not None
        return self.steps.masked_fill(self.escaped, _ESCAPE).to(torch.int8)

    def escape_values(self) -> torch.Tensor:
        assert self.escaped is not None
        return self.values[self.escaped]


def _gather(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, steps: bool) -> _Changes:
    """old, new: flat int16; mask: where they differ. Indices once, then plain gathers (a boolean
    select per tensor is several times slower on the CPU)."""
    index = mask.nonzero().view(-1)
    values = new[index]
    if not steps:
        return _Changes(mask=mask, index=index, values=values)
    step = values - old[index]  # int16 arithmetic wraps: the step from any pattern to any other
    escaped = (step > _STEP_MAX) | (step < -_STEP_MAX)
    return _Changes(mask=mask, index=index, values=values, steps=step, escaped=escaped)


def _smallest(sizes: dict[Kind, int]) -> Kind:
    """The kind of fewest bytes among `sizes`, ties to the earlier in CHOSEN_KINDS."""
    return min((k for k in CHOSEN_KINDS if k in sizes), key=lambda k: sizes[k])


# --- per-tensor encoders -----------------------------------------------------------------------------


def _encoded(kind: Kind, new: torch.Tensor, changed: int, escaped: int = 0, **payload) -> EncodedDelta:
    return EncodedDelta(
        kind=kind,
        shape=tuple(new.shape),
        dtype=new.dtype,
        nbytes=wire_bytes(kind, new.numel(), changed, new.element_size(), escaped),
        changed=changed,
        **payload,
    )


def _sparse_form(new: torch.Tensor, changes: _Changes) -> EncodedDelta:
    if new.numel() > _MAX_INT32_INDEX + 1:
        raise ValueError(f"sparse needs int32 indices: {new.numel()} elements is too many")
    values = changes.values.view(new.dtype)
    return _encoded("sparse", new, changes.changed, values=values, indices=changes.index.to(torch.int32))


def _bitmask_form(new: torch.Tensor, changes: _Changes) -> EncodedDelta:
    values = changes.values.view(new.dtype)
    return _encoded("bitmask", new, changes.changed, values=values, mask=pack_bits(changes.mask))


def _bitmask_i8_form(new: torch.Tensor, changes: _Changes) -> EncodedDelta:
    escapes = changes.escape_values()
    return _encoded(
        "bitmask_i8",
        new,
        changes.changed,
        escapes.numel(),
        mask=pack_bits(changes.mask),
        diffs=changes.diffs(),
        escapes=escapes,
    )


def _dense(new: torch.Tensor, changed: int | None) -> EncodedDelta:
    return EncodedDelta(
        kind="dense",
        shape=tuple(new.shape),
        dtype=new.dtype,
        nbytes=wire_bytes("dense", new.numel(), 0, new.element_size()),
        changed=changed,
        values=new.contiguous(),  # `new` itself when contiguous: no copy
    )


def _changes_of(old: torch.Tensor, new: torch.Tensor, steps: bool) -> _Changes:
    _check_pair(old, new)
    old_bits, new_bits = _flat_bits(old), _flat_bits(new)
    return _gather(old_bits, new_bits, old_bits != new_bits, steps)


def encode_dense(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """`new` itself (the full push); `old` is only checked against it."""
    _check_pair(old, new)
    return _dense(new, None)


def encode_sparse(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """int32 flat indices of the changed elements and their new values."""
    return _sparse_form(new, _changes_of(old, new, steps=False))


def encode_bitmask(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """The packed changed-bits (ceil(numel / 8) bytes) and the changed elements' new values, in order."""
    return _bitmask_form(new, _changes_of(old, new, steps=False))


def encode_bitmask_i8(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """The packed changed-bits, one int8 step per changed element (or the escape -128) and the new bits
    of the escaped elements, in order."""
    return _bitmask_i8_form(new, _changes_of(old, new, steps=True))


def encode_xor_zlib(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """old XOR new as little-endian int16 bytes, zlib level 1. Host-side: a CUDA pair is copied to the CPU."""
    _check_pair(old, new)
    xor = torch.bitwise_xor(_bits(old), _bits(new)).reshape(-1).cpu()
    changed = int(xor.count_nonzero())
    raw = xor.numpy().astype("<i2", copy=False).tobytes()
    blob = zlib.compress(raw, _ZLIB_LEVEL)
    return EncodedDelta(
        kind="xor_zlib",
        shape=tuple(new.shape),
        dtype=new.dtype,
        nbytes=len(blob),
        changed=changed,
        blob=blob,
    )


ENCODERS = {
    "dense": encode_dense,
    "sparse": encode_sparse,
    "bitmask": encode_bitmask,
    "bitmask_i8": encode_bitmask_i8,
    "xor_zlib": encode_xor_zlib,
}


def choose_kind(numel: int, changed: int, itemsize: int = 2, escapes: int = 0) -> Kind:
    """The smallest of CHOSEN_KINDS for these counts (ties: the earlier in CHOSEN_KINDS).

    With escapes=0 (bitmask_i8 at its best) a result other than bitmask_i8 is final whatever the
    escapes: `choose` counts them only when this says bitmask_i8.
    """
    sizes = {k: wire_bytes(k, numel, changed, itemsize, escapes) for k in CHOSEN_KINDS}
    if numel > _MAX_INT32_INDEX + 1:
        del sizes["sparse"]
    return _smallest(sizes)


def choose(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """The smallest exact encoding of new against old: counts the changed elements once (and their
    escapes only if bitmask_i8 could win), builds one form."""
    _check_pair(old, new)
    old_bits, new_bits = _flat_bits(old), _flat_bits(new)
    mask = old_bits != new_bits
    changed = int(mask.count_nonzero())
    numel, itemsize = new.numel(), new.element_size()
    kind = choose_kind(numel, changed, itemsize)
    if kind == "dense":
        return _dense(new, changed)
    changes = _gather(old_bits, new_bits, mask, steps=kind == "bitmask_i8")
    if kind == "bitmask_i8":
        kind = choose_kind(numel, changed, itemsize, changes.escape_count())
    if kind == "sparse":
        return _sparse_form(new, changes)
    if kind == "bitmask":
        return _bitmask_form(new, changes)
    if kind == "bitmask_i8":
        return _bitmask_i8_form(new, changes)
    return _dense(new, changed)


# --- per-tensor apply --------------------------------------------------------------------------------


def _check_target(target: torch.Tensor, encoded: EncodedDelta) -> torch.Tensor:
    if tuple(target.shape) != encoded.shape or target.dtype != encoded.dtype:
        raise ValueError(
            f"a {encoded.kind} delta for {encoded.shape} {encoded.dtype} cannot apply to "
            f"{tuple(target.shape)} {target.dtype}"
        )
    return _bits(target)


def _payload(tensor: torch.Tensor | None, kind: Kind, name: str, device: torch.device) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"a {kind} delta without its {name}")
    return tensor.to(device)


def _scatter_flat(target_bits: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """target.flat[index] = values, in place, through a non-contiguous view as well."""
    if target_bits.is_contiguous():
        target_bits.view(-1)[index] = values
    else:
        target_bits.index_put_(torch.unravel_index(index, target_bits.shape), values)


def _stepped(old: torch.Tensor, diffs: torch.Tensor, escapes: torch.Tensor) -> torch.Tensor:
    """bitmask_i8's new bits of the changed elements: old + step (int16 wrapping), escapes in order.
    The caller has checked that `escapes` has one entry per escape in `diffs`."""
    values = old + diffs.to(torch.int16)
    return values.masked_scatter_(diffs == _ESCAPE, escapes)


def _apply_bitmask_i8(bits: torch.Tensor, encoded: EncodedDelta, device: torch.device) -> None:
    packed = _payload(encoded.mask, "bitmask_i8", "mask", device)
    diffs = _payload(encoded.diffs, "bitmask_i8", "diffs", device)
    escapes = _payload(encoded.escapes, "bitmask_i8", "escapes", device)
    if not diffs.numel():
        return
    escaped = int((diffs == _ESCAPE).count_nonzero())
    if escaped != escapes.numel():
        raise ValueError(
            f"a bitmask_i8 delta with {escaped} escapes in its diffs but {escapes.numel()} values"
        )
    mask = unpack_bits(packed, encoded.numel).view(encoded.shape)
    bits.masked_scatter_(mask, _stepped(bits[mask], diffs, escapes.view(torch.int16)))


def apply(target: torch.Tensor, encoded: EncodedDelta) -> None:
    """Turn `target` (the engine's copy of old, or a view into a larger buffer) into new, in place."""
    bits = _check_target(target, encoded)
    device = target.device
    kind = encoded.kind
    if kind == "dense":
        values = _payload(encoded.values, kind, "values", device)
        bits.copy_(_bits(values).view(encoded.shape))
    elif kind == "sparse":
        index = _payload(encoded.indices, kind, "indices", device).long()
        values = _payload(encoded.values, kind, "values", device)
        if index.numel():
            _scatter_flat(bits, index, _bits(values))
    elif kind == "bitmask":
        packed = _payload(encoded.mask, kind, "mask", device)
        values = _payload(encoded.values, kind, "values", device)
        if values.numel():
            mask = unpack_bits(packed, encoded.numel).view(encoded.shape)
            bits.masked_scatter_(mask, _bits(values))  # in row-major order of the mask
    elif kind == "bitmask_i8":
        _apply_bitmask_i8(bits, encoded, device)
    elif kind == "xor_zlib":
        if encoded.blob is None:
            raise ValueError("a xor_zlib delta without its blob")
        raw = np.frombuffer(zlib.decompress(encoded.blob), dtype="<i2").astype(np.int16, copy=False)
        bits.bitwise_xor_(torch.from_numpy(raw.copy()).to(device).view(encoded.shape))
    else:
        raise ValueError(f"unknown delta kind {kind!r}: use one of {KINDS}")


# --- the bucket codec --------------------------------------------------------------------------------

HEADER_WORDS = 8
MAGIC = int.from_bytes(b"mlsdelta", "little")  # first header word; fits a positive int64
KIND_CODES: dict[Kind, int] = {"dense": 0, "sparse": 1, "bitmask": 2, "bitmask_i8": 3}  # xor_zlib: never sent
_KIND_OF_CODE: dict[int, Kind] = {code: kind for kind, code in KIND_CODES.items()}
_ALIGN = 8  # every payload section starts here, so the receiver views it as int32 / int16 without a copy


class DeltaFormatError(ValueError):
    """A bucket header or payload that is not what `encode_bucket` writes."""


@dataclass(frozen=True)
class BucketDelta:
    """One bucket on the wire: the header (int64 [HEADER_WORDS], on the CPU) says what the payload is.

    Header: [MAGIC, kind code, payload bytes, bucket bytes, changed, escapes, 0, 0]. `changed` counts
    differing int16 words (bytes in an odd-length bucket); `dense_bytes` is what a full push sends.
    """

    kind: Kind
    header: torch.Tensor  # int64 [HEADER_WORDS], on CPU
    payload: torch.Tensor  # uint8 1-D, on new's device
    changed: int
    dense_bytes: int

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _layout(kind: Kind, nbytes: int, changed: int, escapes: int) -> tuple[dict[str, tuple[int, int]], int]:
    """Each section's (start, stop) in the payload, and the payload's bytes."""
    spans, offset = {}, 0
    parts = [("values", nbytes)] if kind == "dense" else sections(kind, nbytes // 2, changed, 2, escapes)
    for name, size in parts:
        start = _align(offset)
        spans[name] = (start, start + size)
        offset = start + size
    return spans, offset


def bucket_payload_bytes(kind: Kind, nbytes: int, changed: int, escapes: int = 0) -> int:
    """Exact payload bytes of `kind` for a bucket of `nbytes` bytes: `wire_bytes` of its int16 words plus
    the padding (under 8 bytes per section) that aligns each section."""
    return _layout(kind, nbytes, changed, escapes)[1]


def _bucket_kind(nbytes: int, changed: int, escapes: int) -> Kind:
    sizes = {k: bucket_payload_bytes(k, nbytes, changed, escapes) for k in CHOSEN_KINDS}
    if nbytes // 2 > _MAX_INT32_INDEX + 1:
        del sizes["sparse"]
    return _smallest(sizes)


def _check_buckets(old: torch.Tensor, new: torch.Tensor) -> None:
    for name, bucket in (("old", old), ("new", new)):
        if bucket.dtype != torch.uint8 or bucket.dim() != 1:
            raise ValueError(
                f"a bucket is a 1-D uint8 tensor; {name} is {bucket.dtype} {tuple(bucket.shape)}"
            )
    if old.numel() != new.numel() or old.device != new.device:
        raise ValueError(
            f"old and new buckets differ: {old.numel()} on {old.device} vs {new.numel()} on {new.device}"
        )


def _words(bucket: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 bucket of even length read as int16 (a copy only at an odd byte offset)."""
    bucket = bucket.contiguous()
    if bucket.storage_offset() % 2:
        bucket = bucket.clone()
    return bucket.view(torch.int16)


def _header(kind: Kind, payload: int, nbytes: int, changed: int, escapes: int) -> torch.Tensor:
    return torch.tensor([MAGIC, KIND_CODES[kind], payload, nbytes, changed, escapes, 0, 0], dtype=torch.int64)


def _dense_bucket(new: torch.Tensor, changed: int) -> BucketDelta:
    nbytes = new.numel()
    header = _header("dense", nbytes, nbytes, changed, 0)
    return BucketDelta("dense", header, new.contiguous(), changed, nbytes)


def _packed_bucket(kind: Kind, new: torch.Tensor, changes: _Changes, escapes: int) -> BucketDelta:
    """One payload, each section written in place (dtype conversions included), padding zeroed so the
    bytes are a function of old and new alone."""
    nbytes = new.numel()
    spans, size = _layout(kind, nbytes, changes.changed, escapes)
    payload = torch.empty(size, dtype=torch.uint8, device=new.device)
    writers = {
        "indices": lambda out: out.view(torch.int32).copy_(changes.index),
        "values": lambda out: out.view(torch.int16).copy_(changes.values),
        "mask": lambda out: out.copy_(pack_bits(changes.mask)),
        "diffs": lambda out: out.view(torch.int8).copy_(changes.diffs()),
        "escapes": lambda out: out.view(torch.int16).copy_(changes.escape_values()),
    }
    offset = 0
    for name, (start, stop) in spans.items():
        payload[offset:start].zero_()
        writers[name](payload[start:stop])
        offset = stop
    header = _header(kind, size, nbytes, changes.changed, escapes)
    return BucketDelta(kind, header, payload, changes.changed, nbytes)


def encode_bucket(old: torch.Tensor, new: torch.Tensor) -> BucketDelta:
    """The smallest delta of bucket `new` against `old` (1-D uint8, same length and device), as one
    header and one payload. An odd-length bucket is always dense. Host syncs: the changed count, and
    the escape count when bitmask_i8 could win."""
    _check_buckets(old, new)
    nbytes = new.numel()
    if nbytes % 2:
        return _dense_bucket(new, int((old != new).count_nonzero()))
    old_words, new_words = _words(old), _words(new)
    mask = old_words != new_words
    changed = int(mask.count_nonzero())
    kind = _bucket_kind(nbytes, changed, 0)
    if kind == "dense":
        return _dense_bucket(new, changed)
    changes = _gather(old_words, new_words, mask, steps=kind == "bitmask_i8")
    escapes = changes.escape_count()
    kind = _bucket_kind(nbytes, changed, escapes)
    if kind == "dense":
        return _dense_bucket(new, changed)
    return _packed_bucket(kind, new, changes, escapes if kind == "bitmask_i8" else 0)


@dataclass(frozen=True)
class _Header:
    kind: Kind
    payload: int
    nbytes: int
    changed: int
    escapes: int


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise DeltaFormatError(message)


def _read_header(header: torch.Tensor) -> _Header:
    """The header's fields, checked for consistency with each other (not yet with target or payload)."""
    _require(
        isinstance(header, torch.Tensor) and header.dtype == torch.int64 and header.shape == (HEADER_WORDS,),
        f"a bucket header is int64 [{HEADER_WORDS}], got "
        + (
            f"{header.dtype} {tuple(header.shape)}"
            if isinstance(header, torch.Tensor)
            else type(header).__name__
        ),
    )
    magic, code, payload, nbytes, changed, escapes, *reserved = header.tolist()
    _require(magic == MAGIC, f"bad magic {magic & 2**64 - 1:#018x} (want {MAGIC:#018x}): not a bucket header")
    _require(code in _KIND_OF_CODE, f"unknown kind code {code}: known {KIND_CODES}")
    kind = _KIND_OF_CODE[code]
    _require(reserved == [0, 0], f"reserved header words are {reserved}, not zero")
    _require(nbytes >= 0, f"bucket size {nbytes} is negative")
    _require(
        kind == "dense" or nbytes % 2 == 0, f"an odd-length bucket ({nbytes} bytes) is dense, not {kind}"
    )
    limit = nbytes // 2 if nbytes % 2 == 0 else nbytes
    _require(0 <= changed <= limit, f"changed {changed} is outside [0, {limit}] for a {nbytes}-byte bucket")
    if kind == "bitmask_i8":
        _require(0 <= escapes <= changed, f"escapes {escapes} is outside [0, changed = {changed}]")
    else:
        _require(escapes == 0, f"a {kind} bucket has no escapes, the header says {escapes}")
    if kind == "sparse":
        _require(nbytes // 2 <= _MAX_INT32_INDEX + 1, f"sparse cannot index a {nbytes}-byte bucket")
    want = bucket_payload_bytes(kind, nbytes, changed, escapes)
    _require(
        payload == want,
        f"payload size {payload} is not {want}, {kind}'s for {nbytes} bytes, {changed} changed",
    )
    return _Header(kind, payload, nbytes, changed, escapes)


def payload_nbytes(header: torch.Tensor) -> int:
    """The payload bytes a receiver must allocate for this header (DeltaFormatError if it is not one)."""
    return _read_header(header).payload


def _aligned(payload: torch.Tensor) -> torch.Tensor:
    payload = payload.contiguous()
    return payload if payload.storage_offset() % _ALIGN == 0 else payload.clone()


def _mask_checks(packed: torch.Tensor, words: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unpacked mask, and its popcount and set padding bits (past `words`) as device scalars."""
    mask = unpack_bits(packed, words)
    used = words % 8 or 8  # bits of the last byte that are elements
    spare = packed[-1:].to(torch.int64).bitwise_right_shift(used).sum()
    return mask, [mask.count_nonzero(), spare]


def _bucket_sparse(words: torch.Tensor, head: _Header, part) -> None:
    index, values = part("indices").view(torch.int32), part("values").view(torch.int16)
    if not head.changed:
        return
    low, high = torch.aminmax(index)
    low, high = torch.stack([low, high]).tolist()
    _require(
        low >= 0 and high < words.numel(),
        f"sparse index out of range: [{low}, {high}] in {words.numel()} words",
    )
    words[index.long()] = values  # long: the index kind every device's index_put takes


def _bucket_bitmask(words: torch.Tensor, head: _Header, part) -> None:
    mask, (count, spare) = _mask_checks(part("mask"), words.numel())
    count, spare = torch.stack([count, spare]).tolist()
    _require(count == head.changed, f"mask popcount {count} is not changed = {head.changed}")
    _require(spare == 0, "mask bits set past the end of the bucket")
    words[mask.nonzero().view(-1)] = part("values").view(torch.int16)


def _bucket_bitmask_i8(words: torch.Tensor, head: _Header, part) -> None:
    mask, checks = _mask_checks(part("mask"), words.numel())
    diffs, escapes = part("diffs").view(torch.int8), part("escapes").view(torch.int16)
    checks += [(diffs == _ESCAPE).count_nonzero(), (diffs == 0).count_nonzero()]
    count, spare, escaped, zero = torch.stack(checks).tolist()
    _require(count == head.changed, f"mask popcount {count} is not changed = {head.changed}")
    _require(spare == 0, "mask bits set past the end of the bucket")
    _require(escaped == head.escapes, f"{escaped} escapes in the diffs, the header says {head.escapes}")
    _require(zero == 0, f"{zero} changed elements with a zero step")
    index = mask.nonzero().view(-1)
    words[index] = _stepped(words[index], diffs, escapes)


_APPLIERS = {"sparse": _bucket_sparse, "bitmask": _bucket_bitmask, "bitmask_i8": _bucket_bitmask_i8}


def apply_bucket(target: torch.Tensor, header: torch.Tensor, payload: torch.Tensor) -> None:
    """Turn bucket `target` (1-D uint8, the engine's old image, possibly a view of parameter memory)
    into new, in place, bit-exact. Every structural check runs before the first write; a failed one
    raises DeltaFormatError and leaves `target` as it was."""
    head = _read_header(header)
    _require(
        target.dtype == torch.uint8 and target.dim() == 1 and target.numel() == head.nbytes,
        f"the header is for a {head.nbytes}-byte bucket, the target is {target.dtype} {tuple(target.shape)}",
    )
    _require(
        payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() == head.payload,
        f"the header says {head.payload} payload bytes, got {payload.dtype} {tuple(payload.shape)}",
    )
    _require(payload.device == target.device, f"payload on {payload.device}, target on {target.device}")
    if head.kind == "dense":
        target.copy_(payload)
        return
    payload = _aligned(payload)
    spans, _ = _layout(head.kind, head.nbytes, head.changed, head.escapes)

    def part(name: str) -> torch.Tensor:
        start, stop = spans[name]
        return payload[start:stop]

    words = _words(target)
    _APPLIERS[head.kind](words, head, part)
    if words.data_ptr() != target.data_ptr():  # `target` could not be read as int16 in place
        target.copy_(words.view(torch.uint8))


# --- digest ----------------------------------------------------------------------------------------

_MASK64 = 2**64 - 1
# int64 words per chunk: the weight table is 512 KiB, a block of rows stays in cache-sized temporaries
DIGEST_CHUNK = 1 << 16
# rows of DIGEST_CHUNK words per step: two 1 MiB scratch buffers that stay in cache on the CPU (measured
# fastest with 2 threads); a GPU wants fewer, larger launches
_LOW48 = (1 << 48) - 1
_LOW32 = (1 << 32) - 1
_BLOCK_ROWS = {"cpu": 2}
_BLOCK_ROWS_OTHER = 64
# splitmix64's finaliser (a bijection of 64-bit words), its constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_weight_tables: dict[tuple[torch.device, int], torch.Tensor] = {}


def _signed(value: int) -> int:
    value &= _MASK64
    return value - 2**64 if value >= 2**63 else value


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in place, with wrapping int64 arithmetic: a bijection of 64-bit words."""
    x.bitwise_xor_(_shr(x, 30)).mul_(_MIX1)
    x.bitwise_xor_(_shr(x, 27)).mul_(_MIX2)
    return x.bitwise_xor_(_shr(x, 31))


def _weights(device: torch.device, chunk: int) -> torch.Tensor:
    """The odd pseudo-random int64 weight of each position in a chunk (splitmix64 of 1..chunk: the same
    on every device and torch version), made once per device."""
    table = _weight_tables.get((device, chunk))
    if table is None:
        table = _mix(torch.arange(1, chunk + 1, dtype=torch.int64, device=device)).bitwise_or_(1)
        _weight_tables[(device, chunk)] = table
    return table


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order as flat uint8 (a contiguous copy only if it is not)."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
    return flat.contiguous().view(torch.uint8)


def _fold(words: torch.Tensor, out: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """out = x ^ (x >>> 16) ^ (x >>> 32) ^ (x >>> 48) for each int64 word x: every 16-bit lane folded
    into the lowest one. A bijection (the top lane is kept, each lower lane xors in those above it), so
    that a change in any lane reaches the low 16 bits, where the weight multiplies it into all 64.
    `spare` is scratch of out's shape; `>>` is arithmetic on int64, so the masks make it logical."""
    torch.bitwise_right_shift(words, 16, out=out)
    out.bitwise_and_(_LOW48).bitwise_xor_(words)
    torch.bitwise_right_shift(out, 32, out=spare)
    return out.bitwise_xor_(spare.bitwise_and_(_LOW32))


def _full_row_sums(raw: torch.Tensor, rows: int, chunk: int, out: torch.Tensor) -> None:
    """out[r] = sum(fold(word_j) * w_j) over row r of `raw` read as int64 [rows, chunk], a block of rows
    at a time through two small scratch buffers."""
    weights = _weights(raw.device, chunk)
    block = _BLOCK_ROWS.get(raw.device.type, _BLOCK_ROWS_OTHER)
    scratch = torch.empty((2, min(block, rows), chunk), dtype=torch.int64, device=raw.device)
    row_bytes = 8 * chunk
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        piece = raw[start * row_bytes : stop * row_bytes]
        if piece.storage_offset() % 8:  # int64 views need 8-byte aligned storage
            piece = piece.clone()
        words = piece.view(torch.int64).view(-1, chunk)
        folded = _fold(words, scratch[0, : stop - start], scratch[1, : stop - start])
        torch.sum(folded.mul_(weights), dim=1, out=out[start:stop])


def _tail_sum(tail: torch.Tensor, chunk: int) -> torch.Tensor:
    """The last, partial row: whole words and the tail bytes zero-padded into one last word."""
    padded = torch.zeros(_align(tail.numel()), dtype=torch.uint8, device=tail.device)
    padded[: tail.numel()] = tail
    words = padded.view(torch.int64)
    folded = _fold(words, torch.empty_like(words), torch.empty_like(words))
    return (folded * _weights(tail.device, chunk)[: words.numel()]).sum()


def _digest_word(tensor: torch.Tensor, chunk: int) -> torch.Tensor:
    """The digest as an int64 scalar on the tensor's device (no host sync)."""
    raw = _raw_bytes(tensor)
    nbytes = raw.numel()
    full, rest = divmod(nbytes, 8 * chunk)
    sums = torch.empty(full + (rest > 0), dtype=torch.int64, device=raw.device)
    _full_row_sums(raw, full, chunk, sums[:full])
    if rest:
        sums[full] = _tail_sum(raw[full * 8 * chunk :], chunk)
    sums += torch.arange(sums.numel(), dtype=torch.int64, device=raw.device) * _GOLDEN
    total = _mix(sums).sum().view(1)
    total.bitwise_xor_(_signed(nbytes))
    total = _mix(total).bitwise_xor_(zlib.crc32(str(tensor.dtype).encode()))
    return _mix(total)[0]


def digest(tensor: torch.Tensor, chunk: int = DIGEST_CHUNK) -> int:
    """A 64-bit content digest of any tensor's bytes, computed with int64 torch ops on its own device.

    The bytes are read as little-endian int64 words (tail bytes zero-padded into one last word), each
    word folded (`_fold`: its four 16-bit lanes xored down into the lowest). Per chunk of `chunk`
    words, S = sum(fold(word_j) * w_j) with wrapping int64 arithmetic, w_j odd pseudo-random per
    position; each chunk's word is splitmix64(S + chunk index * golden), the words are summed, and the
    sum is mixed with the byte length and then a dtype tag. Integer sums wrap alike in any order, so
    the CPU and a GPU agree.

    Any change confined to one 8-byte word changes the digest: fold is a bijection, so fold(word_j)
    changes by some d != 0 mod 2^64, and S by d * w_j, which is not 0 mod 2^64 since odd w_j is
    invertible mod 2^64; splitmix64 and the final mixes are bijections, and only that chunk's word
    changes in the sum. Every element of up to 8 bytes lies inside one word, so any single changed
    element (any flipped bit) changes the digest.

    Several changes collide only if their sum_j d_j * w_j vanishes mod 2^64. Multiplication carries
    upward only, so that has probability about 2^(t - 64), t the lowest set bit among the d_j: the fold
    puts t below 16 whenever a changed word's lanes xor to nonzero (always when one element of up to 2
    bytes changed in it), about 2^-48 as with bf16 elements summed one by one; without the fold two
    sign flips of bf16 elements at the top of their words would always cancel. A checksum against
    corruption and trainer/engine mismatch, not a cryptographic hash: a collision is easy to build on
    purpose. Both sides must use the same `chunk`.
    """
    return int(_digest_word(tensor, chunk).item()) & _MASK64


def digest_many(named: Iterable[tuple[str, torch.Tensor]], packed: bool | None = None) -> dict[str, str]:
    """{name: digest as 16 hex digits} for each tensor, one host sync per device for all of them.

    `packed` (the default off the CPU) digests tensors of up to `_PACK_BYTES` together, a pack at a
    time (`_packed_digest_words`): the same numbers as `digest`, but a model's hundreds of small
    tensors cost a few dozen kernel launches per pack instead of some thirty each, which on a GPU is
    what a per-tensor digest's time is (0.15 s for Qwen3-0.6B's 311 tensors on an H100). On the CPU
    the per-tensor path is already bound by memory, and packing would only add a copy."""
    names: list[str] = []
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for position, (name, tensor) in enumerate(named):
        names.append(name)
        by_device.setdefault(tensor.device, []).append((position, tensor))
    values: list[int] = [0] * len(names)
    for device, entries in by_device.items():
        pack = device.type != "cpu" if packed is None else packed
        order, words = _digest_words(entries, pack)
        for position, value in zip(order, torch.cat(words).tolist(), strict=True):
            values[position] = value & _MASK64
    return {name: f"{value:016x}" for name, value in zip(names, values, strict=True)}


# tensors up to this size are packed together for `digest_many`; a pack's temporaries are about eight
# times its size
_PACK_BYTES = 32 << 20


def _digest_words(
    entries: list[tuple[int, torch.Tensor]], pack: bool
) -> tuple[list[int], list[torch.Tensor]]:
    """The digest words of tensors on one device, as 1-D int64 tensors, and the positions they are for."""
    order: list[int] = []
    words: list[torch.Tensor] = []
    group: list[tuple[int, torch.Tensor]] = []
    group_bytes = 0
    for position, tensor in entries:
        size = tensor.numel() * tensor.element_size()
        if not pack or size > _PACK_BYTES:
            order.append(position)
            words.append(_digest_word(tensor, DIGEST_CHUNK).view(1))
            continue
        if group and group_bytes + size > _PACK_BYTES:
            order.extend(p for p, _ in group)
            words.append(_packed_digest_words([t for _, t in group], DIGEST_CHUNK))
            group, group_bytes = [], 0
        group.append((position, tensor))
        group_bytes += size
    if group:
        order.extend(p for p, _ in group)
        words.append(_packed_digest_words([t for _, t in group], DIGEST_CHUNK))
    return order, words


def _packed_digest_words(tensors: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """`_digest_word` of each tensor, computed for all of them at once: their bytes laid end to end, each
    zero-padded to whole int64 words; every word weighted by its position in its tensor's chunk; row sums
    taken as differences of one wrapping prefix sum (integer sums wrap alike in any order)."""
    device = tensors[0].device
    raws = [_raw_bytes(t) for t in tensors]
    nbytes = [raw.numel() for raw in raws]
    counts = [-(-n // 8) for n in nbytes]
    pad = torch.zeros(8, dtype=torch.uint8, device=device)
    pieces: list[torch.Tensor] = []
    for raw, n, count in zip(raws, nbytes, counts, strict=True):
        pieces += [raw, pad[: 8 * count - n]]
    words = torch.cat(pieces).view(torch.int64)  # a fresh buffer, so 8-byte aligned
    table = _pack_table(counts, nbytes, [t.dtype for t in tensors], chunk, device)
    word_counts, word_starts, row_begin, row_end, row_index, row_tensor, tensor_tags = table
    owner = torch.repeat_interleave(
        torch.arange(len(tensors), device=device), word_counts, output_size=words.numel()
    )
    position = torch.arange(words.numel(), device=device).sub_(word_starts[owner]).remainder_(chunk)
    folded = _fold(words, torch.empty_like(words), owner)  # `owner` is spent: its memory is the scratch
    prefix = folded.mul_(_weights(device, chunk)[position]).cumsum_(0)
    before = torch.where(row_begin > 0, prefix[(row_begin - 1).clamp_(min=0)], 0)
    rows = (prefix[row_end - 1] - before).add_(row_index * _GOLDEN)
    totals = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    totals.index_add_(0, row_tensor, _mix(rows))
    totals.bitwise_xor_(tensor_tags[0])
    return _mix(_mix(totals).bitwise_xor_(tensor_tags[1]))


def _pack_table(
    counts: list[int], nbytes: list[int], dtypes: list[torch.dtype], chunk: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A pack's layout, built on the host and sent in one copy: per tensor its word count and first
    word; per row of `chunk` words its first and end word in the pack, its index in its tensor and its
    tensor; per tensor the byte length and dtype tag the digest mixes in."""
    starts: list[int] = []
    row_begin: list[int] = []
    row_end: list[int] = []
    row_index: list[int] = []
    row_tensor: list[int] = []
    start = 0
    for tensor_index, count in enumerate(counts):
        starts.append(start)
        for row, begin in enumerate(range(start, start + count, chunk)):
            row_begin.append(begin)
            row_end.append(min(begin + chunk, start + count))
            row_index.append(row)
            row_tensor.append(tensor_index)
        start += count
    tags = [_signed(n) for n in nbytes] + [zlib.crc32(str(d).encode()) for d in dtypes]
    flat = counts + starts + row_begin + row_end + row_index + row_tensor + tags
    sizes = [len(counts)] * 2 + [len(row_begin)] * 4 + [len(counts)] * 2
    parts = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True).split(sizes)
    return (*parts[:6], torch.stack(parts[6:]))
