"""The CPU engine's memory occupation: SGLang's `/release_memory_occupation` and
`/resume_memory_occupation`, which let a trainer use the GPU between rollouts (docs/colocation.md).

SGLang 0.5.23's rules (`managers/scheduler_components/weight_updater.py`), kept here:

- tags are `kv_cache`, `weights`, `cuda_graph`; none or an empty list means all of them;
- release asserts the server is idle ("release_memory_occupation should be called only when server is
  idle."): no request holds a KV cache, and none waits unless generation is paused;
- resume of a tag that is not released fails (SGLang's `offload_tags.remove` raises);
- memory is freed only with `--enable-memory-saver`; without it both calls only keep the bookkeeping;
- `--enable-weights-cpu-backup` keeps the weights' content across a release. Without it their content after
  resume is undefined until a weight update loads them (SGLang serves garbage meanwhile; this engine
  allocates empty memory). Buffers (rotary tables) are always kept, as SGLang stashes them.

What this engine does on top (SGLang leaves these to the caller): while `weights` or `kv_cache` is released
new requests wait, as when paused; weight updates while `weights` is released are refused. Freeing works on
storages, not parameters: a storage is resized to nothing and back, so every tensor viewing it (a tied
lm_head is the embedding's Parameter; a bucket laid out back to back is one storage) stays what it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from miles.engines.errors import EngineRefused

if TYPE_CHECKING:
    from miles.engines.cpu.runner import ModelRunner

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
GATING_TAGS = frozenset({WEIGHTS, KV_CACHE})  # while one is released, requests cannot run
NOT_IDLE = "release_memory_occupation should be called only when server is idle."
WEIGHTS_RELEASED = (
    "The weights are released (release_memory_occupation): resume them first "
    '(resume_memory_occupation with tags ["weights"]), then update them.'
)


@dataclass
class MemoryState:
    """Which tags are released, and the rules of the two calls (event-loop side; no awaits inside)."""

    memory_saver: bool = False
    weights_cpu_backup: bool = False
    released: set[str] = field(default_factory=set)

    def tags(self, tags: list[str] | None) -> list[str]:
        """The tags a call names: all for None or []; unknown ones refused (SGLang would record them and
        free nothing, which hides a typo)."""
        if not tags:
            return list(ALL_TAGS)
        unknown = sorted(set(tags) - set(ALL_TAGS))
        if unknown:
            raise EngineRefused(f"unknown memory tags {unknown}: use {list(ALL_TAGS)} (or none for all)")
        return list(dict.fromkeys(tags))

    def check_release(self, *, idle: bool) -> None:
        if not idle:
            raise EngineRefused(NOT_IDLE)

    def check_resume(self, tags: list[str]) -> None:
        """All or nothing: SGLang raises on the first tag that is not released."""
        missing = [tag for tag in tags if tag not in self.released]
        if missing:
            held = sorted(self.released) or "none"
            raise EngineRefused(
                f"resume_memory_occupation: {missing} not released (released: {held}); "
                "resume only what release_memory_occupation released"
            )

    @property
    def gates_requests(self) -> bool:
        return bool(self.released & GATING_TAGS)

    def require_weights(self) -> None:
        if WEIGHTS in self.released:
            raise EngineRefused(WEIGHTS_RELEASED)


# ----- the runner's side (model thread) ------------------------------------------------------------------


@dataclass
class _HeldStorage:
    """One storage of the model's weights, resized to nothing; `backup` (uint8, CPU) restores it."""

    storage: torch.UntypedStorage
    nbytes: int
    backup: torch.Tensor | None


@dataclass
class ReleasedWeights:
    storages: list[_HeldStorage]


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _weight_storages(runner: ModelRunner) -> list[tuple[list[torch.Tensor], bool]]:
    """The tensors of each distinct storage of the model's parameters and buffers, and whether a buffer is
    among them (buffers are always kept, as SGLang stashes them)."""
    groups: dict[int, tuple[list[torch.Tensor], list[bool]]] = {}
    seen: set[int] = set()
    tensors = [(p, False) for p in runner.model.parameters()] + [(b, True) for b in runner.model.buffers()]
    for tensor, is_buffer in tensors:
        if id(tensor) in seen or tensor.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(tensor))
        members, buffer_flags = groups.setdefault(tensor.untyped_storage().data_ptr(), ([], []))
        members.append(tensor)
        buffer_flags.append(is_buffer)
    return [(members, any(flags)) for members, flags in groups.values()]


def _resizable(tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """The tensors' storage, moved first into a resizable one when it is not (safetensors' mmap on CPU)."""
    storage = tensors[0].untyped_storage()
    if storage.resizable():
        return storage
    fresh = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device).untyped_storage()
    # `.data =` keeps every Parameter and buffer object: the modules and runner.params hold them
    for tensor in tensors:
        view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        tensor.data = view.set_(fresh, tensor.storage_offset(), tensor.size(), tensor.stride())
    return fresh


@torch.no_grad()
def release_weights(runner: ModelRunner, *, cpu_backup: bool) -> ReleasedWeights:
    """Free the device memory of every parameter and buffer; their content survives in a CPU copy when
    `cpu_backup` (buffers always). The model must not run until `resume_weights`."""
    held = []
    for tensors, has_buffer in _weight_storages(runner):
        storage = tensors[0].untyped_storage()
        backup = _byte_view(storage).to("cpu", copy=True) if cpu_backup or has_buffer else None
        storage = _resizable(tensors)
        held.append(_HeldStorage(storage, storage.nbytes(), backup))
        storage.resize_(0)
    empty_device_cache(runner.device)
    return ReleasedWeights(held)


@torch.no_grad()
def resume_weights(runner: ModelRunner, released: ReleasedWeights) -> None:
    """Allocate the weights' memory again, with their content where a backup was kept."""
    for item in released.storages:
        item.storage.resize_(item.nbytes)
        if item.backup is not None:
            _byte_view(item.storage).copy_(item.backup)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # copied before the first forward or a sender reuses memory


def empty_device_cache(device: torch.device) -> None:
    """Give memory torch's CUDA allocator caches back to the driver (where another process can use it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
