"""Tensors that lie back to back in one piece of memory: a bucket of weights that needs no packing.

A weight push sends each bucket as one flat byte buffer. When the bucket's tensors already lie back to
back in one storage, in the bucket's order, that buffer is a view of them: the trainer sends it without
packing and an engine receives straight into its parameters. `lay_out_back_to_back` arranges a model's
parameters so; `byte_span` finds such a view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def byte_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A uint8 view covering `tensors` when they are contiguous and lie back to back in one storage in
    this order; else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    start = cursor = first.storage_offset() * first.element_size()
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if tensor.storage_offset() * tensor.element_size() != cursor:
            return None
        cursor += tensor.numel() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (cursor - start,))


@torch.no_grad()
def lay_out_back_to_back(module: torch.nn.Module) -> int:
    """Move `module`'s parameters into one buffer per run of equal dtype and device, in registration
    order (a tied parameter once); returns the number of buffers. The Parameter objects stay the same
    (optimizers and hooks keep working); only their memory moves. Costs one copy of the parameters'
    bytes, transiently."""
    params = list(module.parameters())  # registration order, each Parameter once
    runs: list[list[torch.nn.Parameter]] = []
    for param in params:
        same = runs and runs[-1][0].dtype == param.dtype and runs[-1][0].device == param.device
        if same:
            runs[-1].append(param)
        else:
            runs.append([param])
    for run in runs:
        flat = torch.empty(sum(p.numel() for p in run), dtype=run[0].dtype, device=run[0].device)
        offset = 0
        for param in run:
            view = flat[offset : offset + param.numel()].view(param.shape)
            view.copy_(param.data)
            param.data = view
            offset += param.numel()
    return len(runs)
