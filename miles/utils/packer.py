"""Double-buffered packing of flattened buckets on trainer rank 0.

Bucket k+1 is packed into the spare of two reusable buffers while bucket k is on the wire, so packing
costs no wall time once the first bucket is out. Reusing the buffers matters on CPU as much as the
overlap: a fresh buffer per bucket costs a page fault per 4 KiB (about 130k for 512 MiB, each handing
out a zeroed page) before its first byte is written.

On CUDA the packing runs on a side stream and is ordered against the broadcasts with events (a buffer is
packed over only after the broadcast that read it has finished), so one code path serves gloo and NCCL.

A bucket whose tensors already lie back to back in memory (the trainer lays its parameters out so:
miles/utils/memory.py) is not packed at all: it is sent as a view of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from miles.utils.memory import byte_span


@dataclass(frozen=True)
class PlanLayout:
    """A plan over given tensors: each bucket's tensors, its bytes, and the view of them when they lie back
    to back (sent as they lie, no packing), else None. Finding it walks every tensor, so a push over the
    same tensors and plan as the last one reuses it (miles/weights/sender.py)."""

    buckets: tuple[tuple[torch.Tensor, ...], ...]
    sizes: tuple[int, ...]
    spans: tuple[torch.Tensor | None, ...]


def plan_layout(tensors: Mapping[str, torch.Tensor], plan: Sequence[Sequence[str]]) -> PlanLayout:
    buckets = tuple(tuple(tensors[name] for name in bucket) for bucket in plan)
    sizes = tuple(_aligned_size(names, bucket) for names, bucket in zip(plan, buckets, strict=True))
    return PlanLayout(buckets, sizes, tuple(byte_span(bucket) for bucket in buckets))


class BucketPacker:
    """Packs the buckets of one push, in plan order; `take(k)` then `sent(k)` around bucket k's broadcast."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        plan: Sequence[Sequence[str]],
        device: torch.device,
        layout: PlanLayout | None = None,
    ) -> None:
        if not plan:
            raise ValueError("a push needs at least one bucket")
        layout = layout or plan_layout(tensors, plan)
        self._plan = layout.buckets
        self._sizes = layout.sizes
        self._spans = layout.spans
        packed = [index for index, span in enumerate(self._spans) if span is None]
        self._slot_of = {index: ordinal % 2 for ordinal, index in enumerate(packed)}
        self._device = device
        slots = min(2, len(packed))
        largest = max((self._sizes[index] for index in packed), default=0)
        self._buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda and packed else None
        if self._stream is not None:  # the weights may still be written by the last optimizer step's kernels
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._freed: list[Any] = [None] * slots  # CUDA events: the slot's last broadcast is done with it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-pack")
        self._pending: dict[int, Future[Any]] = {}
        self._start(0)

    @property
    def packed_buckets(self) -> int:
        """How many buckets of the plan need packing (the others are views of the weights)."""
        return len(self._slot_of)

    def take(self, index: int) -> torch.Tensor:
        """Bucket `index` as bytes (waits for its packing), and starts packing bucket `index + 1`."""
        if index not in self._pending:
            raise RuntimeError(f"bucket {index} is not being prepared; buckets are taken in plan order")
        done = self._pending.pop(index).result()
        if done is not None:
            torch.cuda.current_stream(self._device).wait_event(done)
        self._start(index + 1)
        span = self._spans[index]
        return span if span is not None else self._slot(index)[: self._sizes[index]]

    def sent(self, index: int) -> None:
        """Bucket `index`'s broadcast was issued and waited on: its buffer may be packed over."""
        if self._cuda and index in self._slot_of:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            self._freed[self._slot_of[index]] = event

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._stream is not None:
            self._stream.synchronize()
        self._buffers.clear()

    def _slot(self, index: int) -> torch.Tensor:
        return self._buffers[self._slot_of[index]]

    def _start(self, index: int) -> None:
        if index >= len(self._plan):
            return
        if index in self._slot_of:
            self._pending[index] = self._pool.submit(self._pack, index)
        else:  # a view of the weights: nothing to do, already "packed"
            ready: Future[Any] = Future()
            ready.set_result(None)
            self._pending[index] = ready

    def _pack(self, index: int) -> Any:
        """In the packing thread: bucket `index` into its slot; on CUDA, returns the event marking it done."""
        out = self._slot(index)[: self._sizes[index]]
        with ExitStack() as on_side_stream:
            if self._stream is not None:
                on_side_stream.enter_context(torch.cuda.device(self._device))
                on_side_stream.enter_context(torch.cuda.stream(self._stream))
                freed = self._freed[self._slot_of[index]]
                if freed is not None:
                    self._stream.wait_event(freed)
            views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self._plan[index]]
            torch.cat(views, out=out)
            if self._stream is None:
                return None
            done = torch.cuda.Event()
            done.record(self._stream)
            return done


def _aligned_size(names: Sequence[str], bucket: Sequence[torch.Tensor]) -> int:
    """The bucket's bytes; refuses a tensor that would start at an offset not a multiple of its itemsize
    (as buckets.flat_offsets does, from the tensors themselves: this runs for every bucket of every push)."""
    cursor = 0
    for name, tensor in zip(names, bucket, strict=True):
        itemsize = tensor.element_size()
        if cursor % itemsize:
            raise ValueError(
                f"tensor {name!r} would start at byte {cursor}, not a multiple of its itemsize {itemsize}; "
                "plan the buckets with flattened=True"
            )
        cursor += tensor.numel() * itemsize
    return cursor
