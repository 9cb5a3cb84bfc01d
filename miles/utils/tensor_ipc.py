"""Named tensors as SGLang's `/update_weights_from_tensor` payload: handles to memory, not bytes.

Wire shape (SGLang 0.5.23's `MultiprocessingSerializer.serialize(named, output_str=True)`): a
`ForkingPickler` dump of the list of `(name, tensor)` pairs, as base64 text. The pickle carries no tensor
data, only where it lives:

- **CUDA tensors** travel as CUDA IPC handles (torch's `reduce_tensor`). The device is sent as the GPU's
  UUID string in place of its index, as SGLang's patched `reduce_tensor` does (`srt/utils/patch_torch.py`),
  and the receiver maps a UUID (or a plain int) to its own index: two processes with different
  `CUDA_VISIBLE_DEVICES` number the same GPU differently, but agree on its UUID.
- **CPU tensors** travel as shared-memory file names (torch's `file_system` strategy), whatever the
  process's global sharing strategy: the default `file_descriptor` strategy sends a `DupFd` that only a
  process holding the sender's multiprocessing authkey can redeem, and an engine is an unrelated process.
  Sharing moves each CPU storage into shared memory once (a copy; the tensor objects and their values stay
  the same, and later payloads of the same storage copy nothing).

Lifetime: the receiver maps the sender's memory, it does not own it. **The sender must keep the tensors
alive and unchanged until the receiver has answered** (the HTTP call returned): CUDA memory freed or
reused by the sender's allocator before the engine copied it is read after free. The CPU engine copies every
received tensor into its own parameters and drops the mapping before it answers; SGLang does the same.

The receiver unpickles with an allowlist (`_ALLOWED`): the payload arrives over HTTP, and a pickle can call
any importable function. Only torch's rebuild functions for these two paths, the storage and tensor classes
they name, `torch.Size` and torch dtypes are resolved; anything else raises `TensorPayloadError`.

**Flattened buckets** (`load_format="flattened_bucket"`, SGLang's `FlattenedTensorBucket`): the payload is
one dict, `{"flattened_tensor": <uint8 tensor>, "metadata": [FlattenedTensorMetadata, ...]}`, each entry
naming a tensor's bytes `[start_idx, end_idx)` in the buffer. One tensor crosses instead of hundreds: one
IPC handle to open, one event, one mapping. The metadata must pickle as SGLang's own class
(`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`, on SGLang's unpickler allowlist), and a
trainer must not import sglang (its import patches transformers), so the sender pickles a local class of the
same fields and renames its one `GLOBAL` opcode (protocol 3: no frames, no lengths to fix up).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import pickletools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions  # importing it registers torch's reducers with ForkingPickler

from miles.utils.buckets import TensorMeta, flat_offsets, flat_views

NamedTensors = list[tuple[str, torch.Tensor]]
_DEVICE_ARG = 6  # position of the device in rebuild_cuda_tensor's arguments (SGLang patches the same one)


class TensorPayloadError(ValueError):
    """A payload that is not base64 of an allowed pickle of (name, tensor) pairs."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's `FlattenedTensorMetadata` (srt/weight_sync/tensor_bucket.py), field for field: one tensor of
    a flattened bucket, its bytes `[start_idx, end_idx)` of the uint8 buffer, `numel` those bytes' count."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_FLAT_PROTOCOL = 3  # GLOBAL opcodes in text, no framing: the class can be renamed in place


# ----- sender --------------------------------------------------------------------------------------------


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """torch's reduction, with a CUDA tensor's device index replaced by the GPU's UUID."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_DEVICE_ARG], int):  # SGLang's patch, if loaded, did it already
        args = (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def _reduce_storage_by_filename(storage: torch.UntypedStorage) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """torch's `file_system` reduction of a CPU storage, independent of the global sharing strategy."""
    if storage.is_cuda:
        raise TypeError("a CUDA storage is shared through its tensor (CUDA IPC), not on its own")
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    # One reference for the receiver, dropped by its rebuild_storage_filename: the shared-memory file
    # outlives the sender's own tensor until the receiver mapped it.
    storage._shared_incref()
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _pickler(buffer: io.BytesIO, protocol: int | None = None) -> ForkingPickler:
    pickler = ForkingPickler(buffer, protocol)
    table = dict(pickler.dispatch_table)  # per pickler: the process-wide registry stays as it is
    for cls in (torch.Tensor, torch.nn.Parameter, *torch._tensor_classes):
        table[cls] = _reduce_tensor
    table[torch.UntypedStorage] = _reduce_storage_by_filename
    pickler.dispatch_table = table
    return pickler


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry: base64 of a ForkingPickler dump of `named` (handles only).
    Keep the tensors alive and unchanged until the receiving engine answered (module docstring)."""
    pairs = []
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got ({type(name)}, {type(tensor)})")
        # autograd state does not cross processes; a non-leaf tensor would be refused by torch anyway
        pairs.append((name, tensor.detach()))
    buffer = io.BytesIO()
    _pickler(buffer).dump(pairs)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass(frozen=True)
class FlattenedLayout:
    """A flattened bucket's plan: each tensor's bytes as a uint8 view (miles.utils.buckets.flat_views) and
    SGLang's metadata for them. `pack()` copies the tensors' current values into one new buffer, one `cat`.
    Of contiguous tensors the views are their own memory: the layout then packs their current values push
    after push, while they stay where they are."""

    views: tuple[torch.Tensor, ...]
    metadata: tuple[FlattenedTensorMetadata, ...]

    def pack(self) -> torch.Tensor:
        return torch.cat(self.views)


def flattened_layout(named: Sequence[tuple[str, torch.Tensor]]) -> FlattenedLayout:
    """The layout of one bucket holding `named` back to back (the distributed push's flattened layout:
    plan the buckets with `flattened=True`, or a misaligned tensor is refused)."""
    if not named:
        raise ValueError("a flattened bucket needs at least one tensor")
    metas = [TensorMeta.of(name, tensor) for name, tensor in named]
    metadata = tuple(
        FlattenedTensorMetadata(
            meta.name, tensor.shape, tensor.dtype, start, start + meta.nbytes, meta.nbytes
        )
        for meta, (_, tensor), start in zip(metas, named, flat_offsets(metas), strict=True)
    )
    return FlattenedLayout(tuple(flat_views([tensor for _, tensor in named])), metadata)


def flatten_bucket(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """One uint8 buffer holding the tensors back to back, and their metadata (`flattened_layout`, packed
    once). A copy: the caller may change the tensors once this returns, and must keep the buffer until the
    receiver answered."""
    layout = flattened_layout(named)
    return layout.pack(), list(layout.metadata)


def serialize_flattened_bucket(buffer: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> str:
    """One `serialized_named_tensors` entry for `load_format="flattened_bucket"`: SGLang's dict, the
    metadata pickled as SGLang's class. Keep `buffer` alive and unchanged until the engine answered."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError(
            f"a flattened bucket is a 1-D uint8 tensor, got {buffer.dtype} of shape {tuple(buffer.shape)}"
        )
    payload = {"flattened_tensor": buffer.detach(), "metadata": list(metadata)}
    out = io.BytesIO()
    _pickler(out, _FLAT_PROTOCOL).dump(payload)
    return base64.b64encode(_as_sglang_class(out.getvalue())).decode("ascii")


def _as_sglang_class(raw: bytes) -> bytes:
    """Rename the local metadata class's GLOBAL opcode to SGLang's (one per pickle: later uses are memo
    references). Located by parsing the pickle, never by searching its bytes."""
    ours = f"{FlattenedTensorMetadata.__module__} {FlattenedTensorMetadata.__qualname__}"
    renamed = b"c" + "\n".join(SGLANG_METADATA).encode("ascii") + b"\n"
    for opcode, arg, pos in pickletools.genops(raw):
        if opcode.name == "GLOBAL" and arg == ours:
            end = pos + 1 + len(ours) + 1  # "c" module "\n" name "\n": the space in `arg` is the first "\n"
            return raw[:pos] + renamed + raw[end:]
    raise AssertionError("the flattened bucket's pickle names no metadata class")  # metadata is never empty


# ----- receiver ------------------------------------------------------------------------------------------


def _local_device(device: int | str) -> int:
    """A device index of this process for an index or a GPU UUID (SGLang's `_device_from_maybe_uuid`)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == device:
                return index
        raise TensorPayloadError(
            f"the payload's tensors live on GPU {device}, which is none of this process's "
            f"{torch.cuda.device_count()} visible GPUs: sender and engine must share a GPU"
        )
    raise TensorPayloadError(f"a CUDA device must be an index or a UUID string, got {device!r}")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise TensorPayloadError("the payload holds CUDA IPC handles, and this process has no CUDA")
    args = (*args[:_DEVICE_ARG], _local_device(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(*args)


def _allowed() -> dict[tuple[str, str], Any]:
    rebuilds = "torch.multiprocessing.reductions"
    allowed: dict[tuple[str, str], Any] = {
        (rebuilds, "rebuild_tensor"): reductions.rebuild_tensor,
        (rebuilds, "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        (rebuilds, "rebuild_storage_filename"): reductions.rebuild_storage_filename,
        (rebuilds, "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        (rebuilds, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        # what a sender running SGLang's patch_torch pickles instead (the same arguments, UUID included)
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
        ("torch", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch", "Size"): torch.Size,
        SGLANG_METADATA: FlattenedTensorMetadata,  # a flattened bucket's metadata: data, no code
    }
    for name in dir(torch):  # dtypes pickle as globals of torch (torch.bfloat16, ...): data, not code
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


_ALLOWED = _allowed()


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        hint = ""
        if name in ("DupFd", "rebuild_storage_fd"):
            hint = (
                " (CPU tensors pickled with the file_descriptor strategy: only the sender's own children can "
                "open them; use miles.utils.tensor_ipc.serialize_named_tensors)"
            )
        raise TensorPayloadError(f"{module}.{name} is not allowed in a tensor payload{hint}")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one `serialized_named_tensors` entry, mapped onto the sender's memory
    (copy them before answering the sender; drop them after). Raises TensorPayloadError for anything else."""
    return _checked(_unpickled(payload))


def deserialize_flattened_bucket(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one `load_format="flattened_bucket"` entry: views into the sender's
    buffer, mapped (copy them before answering; drop them after). Raises TensorPayloadError for a payload
    that is not SGLang's dict, or metadata that reads outside the buffer or at a misaligned offset."""
    bucket = _unpickled(payload)
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise TensorPayloadError(
            "a flattened_bucket payload must be a dict with exactly 'flattened_tensor' and 'metadata'"
        )
    buffer, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TensorPayloadError("'flattened_tensor' must be a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not metadata:
        raise TensorPayloadError("'metadata' must be a non-empty list of FlattenedTensorMetadata")
    return [_named_view(buffer, meta) for meta in metadata]


def _named_view(buffer: torch.Tensor, meta: Any) -> tuple[str, torch.Tensor]:
    if not isinstance(meta, FlattenedTensorMetadata):
        raise TensorPayloadError(
            f"'metadata' entries must be FlattenedTensorMetadata, got {type(meta).__name__}"
        )
    try:  # the unpickler sets the fields as sent: any types, any missing
        return _checked_view(buffer, meta)
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        name = getattr(meta, "name", "?")
        raise TensorPayloadError(f"metadata {name!r} is malformed: {type(exc).__name__}: {exc}") from exc


def _checked_view(buffer: torch.Tensor, meta: FlattenedTensorMetadata) -> tuple[str, torch.Tensor]:
    ints = (meta.start_idx, meta.end_idx, *meta.shape)
    if not isinstance(meta.name, str) or not isinstance(meta.dtype, torch.dtype):
        raise TensorPayloadError(f"metadata {meta.name!r}: name must be a str and dtype a torch dtype")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        raise TensorPayloadError(f"metadata {meta.name!r}: start_idx, end_idx and shape must be integers")
    shape = torch.Size(meta.shape)
    nbytes = shape.numel() * meta.dtype.itemsize
    start, end = meta.start_idx, meta.end_idx
    if any(d < 0 for d in shape) or not 0 <= start <= end <= buffer.numel() or end - start != nbytes:
        raise TensorPayloadError(
            f"metadata {meta.name!r}: bytes [{start}, {end}) of a {buffer.numel()}-byte buffer do not hold a "
            f"{meta.dtype} tensor of shape {tuple(shape)} ({nbytes} bytes)"
        )
    if (buffer.storage_offset() + start) % meta.dtype.itemsize:
        raise TensorPayloadError(f"metadata {meta.name!r}: byte {start} is not aligned to {meta.dtype}")
    return meta.name, buffer[start:end].view(meta.dtype).reshape(shape)


def _unpickled(payload: str) -> Any:
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise TensorPayloadError(f"the payload is not base64: {exc}") from exc
    try:
        named = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except TensorPayloadError:
        raise
    except Exception as exc:  # truncated or corrupt pickles raise many types; one answer for all
        raise TensorPayloadError(f"the payload does not unpickle: {type(exc).__name__}: {exc}") from exc
    return named


def _checked(named: Any) -> NamedTensors:
    if not isinstance(named, list):
        raise TensorPayloadError(f"the payload must hold a list of (name, tensor) pairs, got {type(named)}")
    for item in named:
        ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
        if not ok or not isinstance(item[1], torch.Tensor):
            raise TensorPayloadError("the payload must hold a list of (name, tensor) pairs")
    return named
