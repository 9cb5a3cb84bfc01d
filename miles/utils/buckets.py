"""Pure bucketing of named tensors by bytes, and the flattened-bucket byte layout.

A bucket is what one `update_weights_from_distributed` call (and one broadcast from trainer rank 0)
carries. Buckets keep the tensors' order; a tensor larger than the limit gets a bucket of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class TensorMeta:
    """What an engine needs to allocate a receive buffer: HF name, dtype name (no `torch.`), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling SGLang resolves with `getattr(torch, name)`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dtype


def plan_buckets(
    metas: Iterable[TensorMeta], max_bytes: int = DEFAULT_BUCKET_BYTES, *, flattened: bool = False
) -> list[list[TensorMeta]]:
    """Split `metas` into consecutive buckets of at most `max_bytes` each (order preserved).

    With `flattened`, a bucket is also closed before a tensor whose offset in the plain concatenation
    would not be a multiple of its itemsize, so the packed buffer needs no padding: an engine unpacking
    "the concatenation of all tensors' bytes in list order" reads every tensor at an aligned offset.
    """
    if max_bytes <= 0:
        raise ValueError(f"bucket size must be a positive number of bytes, got {max_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    current_bytes = 0
    for meta in metas:
        over_limit = current and current_bytes + meta.nbytes > max_bytes
        misaligned = flattened and current and current_bytes % meta.itemsize != 0
        if over_limit or misaligned:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(meta)
        current_bytes += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def flat_offsets(metas: Sequence[TensorMeta]) -> list[int]:
    """Byte offset of each tensor in the plain concatenation; refuses a misaligned layout."""
    offsets, cursor = [], 0
    for meta in metas:
        if cursor % meta.itemsize != 0:
            raise ValueError(
                f"tensor {meta.name!r} would start at byte {cursor}, not a multiple of its itemsize "
                f"{meta.itemsize}; plan the buckets with flattened=True"
            )
        offsets.append(cursor)
        cursor += meta.nbytes
    return offsets


def pack_flat(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta]) -> torch.Tensor:
    """One contiguous uint8 buffer holding `tensors` back to back (the `flattened_bucket` format)."""
    flat_offsets(metas)
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(flat_views(tensors))


def flat_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bytes as a 1-D uint8 tensor, what `pack_flat` concatenates: a view of the tensor's own
    memory when it is contiguous, else of a contiguous copy."""
    return [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]


def unpack_flat(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Views into `buffer` with each tensor's dtype and shape (inverse of `pack_flat`)."""
    out = []
    for meta, offset in zip(metas, flat_offsets(metas), strict=True):
        raw = buffer[offset : offset + meta.nbytes]
        out.append(raw.view(dtype_from_name(meta.dtype)).reshape(meta.shape))
    return out
