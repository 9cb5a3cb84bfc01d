"""Context parallelism without Transformer Engine: which sequence positions a CP rank holds, and the two
gathers over the CP group that the attention and the logprobs need.

The (right-padded) sequence of width W is cut into 2 x CP chunks of W / (2 CP) tokens; CP rank r holds
chunks r and 2 CP - 1 - r, in that order. Under a causal mask the early chunks are cheap and the late ones
dear, so each rank gets one of each and the ranks' attention costs are equal. This is megatron-core's own
layout (`get_pos_emb_on_this_cp_rank` slices the rotary table the same way), so megatron's RoPE, which sees
the rank's tokens only, turns each of them by its true position.

- `gather_kv`: a layer's keys or values [s_local, ...] all-gathered over CP into sequence order [W, ...];
  its backward reduce-scatters the gradient (every rank's queries attend to every rank's keys, so a key's
  gradient is the sum of the ranks' contributions).
- `attend_context_parallel`: the rank's queries against the gathered keys and values. Each local query chunk
  attends causally to the keys up to its own end: a lower-right causal bias (query i of a chunk ending at e
  sees keys < e - chunk + i + 1), which torch dispatches to the flash kernel on CUDA (whose causal flag is
  lower-right) or to the memory-efficient one, and to a materialised [chunk, e] mask only where neither
  runs (the CPU). This is how Llama 3 trained at long context: one all-gather of K and V per layer and
  their reduce-scatter in the backward, and one layer's whole-sequence K and V held (GQA: KV heads only).
- `gather_outputs`: per-token outputs [b, s_local, ...] (logprobs) all-gathered into sequence order
  [b, W, ...], so every CP rank computes the losses on whole sequences exactly as at CP 1. Every CP rank
  computes the same loss from the same gathered tensor, so the backward keeps only the rank's own slice of
  the gradient (not a sum): the gradients of the weights are then each rank's partial sums, which megatron's
  DDP sums over the data x context parallel group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# torch >= 2.9 names the single-tensor collectives *_single; older ones *_tensor (the same operation)
_all_gather = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
_reduce_scatter = getattr(torch_dist, "reduce_scatter_single", None) or torch_dist.reduce_scatter_tensor


def local_positions(width: int, size: int, rank: int) -> torch.Tensor:
    """The sequence positions CP rank `rank` of `size` holds, in its order: chunks rank and 2 size-1-rank."""
    if width % (2 * size):
        raise ValueError(f"a width of {width} tokens does not cut into 2 x {size} context-parallel chunks")
    chunk = width // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def sequence_order(width: int, size: int) -> torch.Tensor:
    """Index into the rank-ordered concatenation of every rank's positions that puts it in sequence order."""
    gathered = torch.cat([local_positions(width, size, r) for r in range(size)])
    return torch.argsort(gathered)


@functools.lru_cache(maxsize=64)
def _index_on(kind: str, width: int, size: int, rank: int, device: torch.device) -> torch.Tensor:
    """`local_positions` or `sequence_order` on a device, made once per shape: every layer's K/V gather
    reorders by the same index, and a host-to-device copy per layer would wait for the device. Read only."""
    index = local_positions(width, size, rank) if kind == "local" else sequence_order(width, size)
    return index.to(device)


def chunk_ends(width: int, size: int, rank: int) -> tuple[int, int]:
    """The end position (exclusive) of each of the rank's two chunks: its queries attend to keys before it."""
    chunk = width // (2 * size)
    return (rank + 1) * chunk, (2 * size - rank) * chunk


@dataclass(frozen=True)
class ContextSplit:
    """One CP rank's place: group size, rank and group (None: the default group)."""

    size: int
    rank: int
    group: object = None

    def local(self, padded: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The rank's positions of a [.., W, ..] tensor along `dim`, in its order."""
        index = _index_on("local", padded.shape[dim], self.size, self.rank, padded.device)
        return padded.index_select(dim, index)

    def real_positions(self, lengths: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, local columns) of the real (unpadded) tokens among the rank's positions, row by row:
        computed on the host from the lengths, so selecting them needs no device sync."""
        positions = local_positions(width, self.size, self.rank)
        rows, cols = [], []
        for row, length in enumerate(lengths):
            keep = torch.nonzero(positions < length).flatten()
            rows.append(torch.full_like(keep, row))
            cols.append(keep)
        return torch.cat(rows), torch.cat(cols)


class _GatherSum(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, size: int, group) -> torch.Tensor:
        ctx.size, ctx.group = size, group
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _GatherSlice(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward: this rank's own slice of the gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, size: int, rank: int, group) -> torch.Tensor:
        ctx.rank, ctx.rows = rank, local.shape[0]
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None, None, None


def gather_kv(local: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """[s_local, ...] keys or values of every CP rank, in sequence order [W, ...] (gradient summed back)."""
    gathered = _GatherSum.apply(local, split.size, split.group)
    order = _index_on("order", gathered.shape[0], split.size, 0, local.device)
    return gathered.index_select(0, order)


def gather_outputs(local: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """[b, s_local, ...] per-token outputs of every CP rank, in sequence order [b, W, ...] (the backward
    keeps the rank's own slice: every rank computes the same loss from them)."""
    gathered = _GatherSlice.apply(local.transpose(0, 1), split.size, split.rank, split.group)
    order = _index_on("order", gathered.shape[0], split.size, 0, local.device)
    return gathered.index_select(0, order).transpose(0, 1)


def attend_context_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, split: ContextSplit
) -> torch.Tensor:
    """[b, heads, s_local, d] queries of the rank's two chunks against every rank's keys and values (local
    [b, kv_heads, s_local, d], gathered here): each chunk sees the keys before its end, causally."""
    keys, values = (gather_kv(t.permute(2, 0, 1, 3), split).permute(1, 2, 0, 3) for t in (k, v))
    chunk = q.shape[2] // 2
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for part, end in zip(
        q.split(chunk, dim=2), chunk_ends(keys.shape[2], split.size, split.rank), strict=True
    ):
        bias = causal_lower_right(chunk, end)
        k_end, v_end = keys[:, :, :end], values[:, :, :end]
        outs.append(
            F.scaled_dot_product_attention(part, k_end, v_end, attn_mask=bias, scale=scale, enable_gqa=gqa)
        )
    return torch.cat(outs, dim=2)
