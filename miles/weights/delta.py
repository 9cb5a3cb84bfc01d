"""Weight deltas between two bf16 images: encode what changed, apply it in place, prove it with a digest.

Why: after one optimizer step at RL learning rates only a few percent of the bf16 values an engine holds
change (the trainer steps fp32 master weights; the bf16 copy moves only where rounding flips), yet the
full push sends every byte. A delta push (issue 36) keeps, per engine group, the bf16 image the engines
hold and sends per bucket only what changed, in the smallest of these forms:

  dense     the new tensor itself                            numel * 2 bytes
  sparse    int32 flat indices of changed elements + values  changed * (4 + 2) bytes
  bitmask   packed "changed" bits (numel / 8) + values       ceil(numel / 8) + changed * 2 bytes
  xor_zlib  old XOR new as int16, zlib level 1 (host only)   measured; not chosen by `choose`

`choose` compares the exact byte counts, which depend only on numel and the number of changed elements,
so it counts once and materialises one encoding. Sparse wins below changed/numel ~ 1/32, bitmask up to
~ 15/16, dense above (`wire_bytes`). Values are compared and written as their int16 bits, so the result
is bit-exact (NaN payloads and -0.0 included). `digest` is a 64-bit checksum both sides compute after a
delta push, on the tensor's own device, to prove the engine holds exactly the trainer's image.

Pure torch, device-agnostic, no I/O: the wire protocol that carries these payloads is elsewhere.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Kind = Literal["dense", "sparse", "bitmask", "xor_zlib"]
KINDS: tuple[Kind, ...] = ("dense", "sparse", "bitmask", "xor_zlib")
# the forms `choose` compares; on equal bytes the earlier wins (dense needs no work on either side)
CHOSEN_KINDS: tuple[Kind, ...] = ("dense", "bitmask", "sparse")
INDEX_BYTES = 4  # int32 flat indices
_MAX_INT32_INDEX = 2**31 - 1
_GATHER = 0x0102040810204080  # sum of 2^(56 - 7i), i = 0..7: see pack_bits
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)  # bit i of a mask byte is element 8 * byte + i
_ZLIB_LEVEL = 1


@dataclass(frozen=True)
class EncodedDelta:
    """What goes on the wire for one tensor, and what `apply` needs to rebuild `new` from `old`.

    `values` are the new values (dense: all of them, in row-major order; sparse and bitmask: of the
    changed elements, in increasing flat index). `indices` (sparse, int32), `mask` (bitmask, packed uint8)
    and `blob` (xor_zlib) are set only for their kind. `nbytes` is the payload's size on the wire.
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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def wire_bytes(kind: Kind, numel: int, changed: int, itemsize: int = 2) -> int:
    """Exact payload bytes of `kind` for a tensor of `numel` elements of which `changed` differ."""
    if kind == "dense":
        return numel * itemsize
    if kind == "sparse":
        return changed * (INDEX_BYTES + itemsize)
    if kind == "bitmask":
        return (numel + 7) // 8 + changed * itemsize
    raise ValueError(f"{kind!r} has no byte formula (it is measured): use one of {CHOSEN_KINDS}")


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw 16-bit patterns, same shape and strides (a view: writes go through)."""
    if tensor.element_size() != 2 or not tensor.is_floating_point():
        raise ValueError(f"deltas need a 2-byte float dtype (bfloat16, float16), got {tensor.dtype}")
    return tensor.view(torch.int16)


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
    return (_bits(old) != _bits(new)).reshape(-1)


def _select(new: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """new.flat[where] (indices or a flat bool mask), moved as bits so every pattern survives as is."""
    return _bits(new).reshape(-1)[where].view(new.dtype)


def _sparse_from(mask: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    if mask.numel() > _MAX_INT32_INDEX + 1:
        raise ValueError(f"sparse needs int32 indices: {mask.numel()} elements is too many")
    index = mask.nonzero().view(-1)
    values = _select(new, index)
    changed = index.numel()
    return EncodedDelta(
        kind="sparse",
        shape=tuple(new.shape),
        dtype=new.dtype,
        nbytes=wire_bytes("sparse", new.numel(), changed, new.element_size()),
        changed=changed,
        values=values,
        indices=index.to(torch.int32),
    )


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8 of ceil(n / 8) bytes; element 8 * j + i is bit i of byte j.

    Eight bools (bytes 0/1) read as one little-endian int64 x; x * _GATHER puts byte i's bit at bit 56 + i
    with no carries (every partial product lands on its own bit), so the top byte is the packed byte.
    """
    flat = mask.reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad or flat.storage_offset() % 8:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64) * _GATHER
    return ((words >> 56) & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of `pack_bits`: the first `numel` bits as a flat bool tensor."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.view(-1, 1) & weights).ne(0).view(-1)[:numel]


def _bitmask_from(mask: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    values = _select(new, mask)
    changed = values.numel()
    return EncodedDelta(
        kind="bitmask",
        shape=tuple(new.shape),
        dtype=new.dtype,
        nbytes=wire_bytes("bitmask", new.numel(), changed, new.element_size()),
        changed=changed,
        values=values,
        mask=pack_bits(mask),
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


def encode_dense(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """`new` itself (the full push); `old` is only checked against it."""
    _check_pair(old, new)
    return _dense(new, None)


def encode_sparse(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """int32 flat indices of the changed elements and their new values."""
    return _sparse_from(changed_mask(old, new), new)


def encode_bitmask(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """The packed changed-bits (ceil(numel / 8) bytes) and the changed elements' new values, in order."""
    return _bitmask_from(changed_mask(old, new), new)


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
    "xor_zlib": encode_xor_zlib,
}


def choose_kind(numel: int, changed: int, itemsize: int = 2) -> Kind:
    """The smallest of dense / bitmask / sparse for this count (ties: the earlier in CHOSEN_KINDS)."""
    kinds = [k for k in CHOSEN_KINDS if k != "sparse" or numel <= _MAX_INT32_INDEX + 1]
    return min(kinds, key=lambda k: wire_bytes(k, numel, changed, itemsize))


def choose(old: torch.Tensor, new: torch.Tensor) -> EncodedDelta:
    """The smallest exact encoding of new against old: counts the changed elements once, builds one form."""
    mask = changed_mask(old, new)
    changed = int(mask.count_nonzero())
    kind = choose_kind(new.numel(), changed, new.element_size())
    if kind == "sparse":
        return _sparse_from(mask, new)
    if kind == "bitmask":
        return _bitmask_from(mask, new)
    return _dense(new, changed)


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
    elif kind == "xor_zlib":
        if encoded.blob is None:
            raise ValueError("a xor_zlib delta without its blob")
        raw = np.frombuffer(zlib.decompress(encoded.blob), dtype="<i2").astype(np.int16, copy=False)
        bits.bitwise_xor_(torch.from_numpy(raw.copy()).to(device).view(encoded.shape))
    else:
        raise ValueError(f"unknown delta kind {kind!r}: use one of {KINDS}")


# --- digest ----------------------------------------------------------------------------------------

_MASK64 = 2**64 - 1
# elements per pass: bounds the int64 temporaries (and the weight table) at 8 MiB each per device
DIGEST_CHUNK = 1 << 20
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


def digest(tensor: torch.Tensor, chunk: int = DIGEST_CHUNK) -> int:
    """A 64-bit content digest of a 2-byte float tensor, computed with torch ops on its own device.

    Per chunk of `chunk` elements, S = sum(bits_j * w_j) with wrapping int64 arithmetic, w_j odd
    pseudo-random per position; each chunk's word is splitmix64(S + chunk index * golden), the words are
    summed, and the sum is mixed with numel and dtype. One changed element changes S by d * w_j with
    d nonzero and below 2^16 and w_j odd, never 0 mod 2^64: the digest always changes. Swapped elements,
    shifted slices and other changes collide only if a random-weighted sum vanishes mod 2^64 (about
    2^-48). A checksum against corruption and trainer/engine mismatch, not a cryptographic hash: a
    collision is easy to build on purpose. Both sides must use the same `chunk`.
    """
    flat = _bits(tensor).reshape(-1)
    numel = flat.numel()
    weights = _weights(flat.device, chunk)
    sums = [
        (flat[start : start + chunk].to(torch.int64) * weights[: min(chunk, numel - start)]).sum()
        for start in range(0, numel, chunk)
    ]
    total = 0
    if sums:
        words = torch.stack(sums)
        words += torch.arange(len(sums), dtype=torch.int64, device=flat.device) * _GOLDEN
        total = int(_mix(words).sum().item())
    tag = zlib.crc32(str(tensor.dtype).encode())
    head = torch.tensor([_signed(total ^ (numel << 32 | tag))], dtype=torch.int64)
    return int(_mix(head).item()) & _MASK64
