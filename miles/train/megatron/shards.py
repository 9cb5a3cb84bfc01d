"""Tensor-parallel split and merge of one megatron tensor, by kind (see weights.TpKind).

Column-parallel layers hold a contiguous slice of output rows. The grouped `linear_qkv` layout makes that
slice whole KV groups when the TP size divides the KV heads, and a part of one group (its KV head
replicated by megatron's attention) when the TP size is a multiple of the KV heads: either way an even cut
of rows. `linear_fc1` is cut as gate and up separately, since each rank computes its own gate * up.
"""

from __future__ import annotations

import torch

from miles.train.megatron.weights import TpKind

_DIM = {"column": 0, "vocab": 0, "row": 1}


def _check_divides(tensor: torch.Tensor, dim: int, tp: int, what: str) -> None:
    if tensor.shape[dim] % tp:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(tensor.shape)} does not split over TP={tp}")


def split(tensor: torch.Tensor, kind: TpKind, tp: int) -> list[torch.Tensor]:
    """The `tp` shards of an unsharded tensor, rank order (contiguous copies)."""
    if kind == "replicated":
        return [tensor.clone() for _ in range(tp)]
    if kind == "gate_up":
        gate, up = torch.chunk(tensor, 2, dim=0)
        _check_divides(gate, 0, tp, kind)
        return [torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp, 0), up.chunk(tp, 0), strict=True)]
    dim = _DIM[kind]
    _check_divides(tensor, dim, tp, kind)
    return [part.contiguous() for part in torch.chunk(tensor, tp, dim=dim)]


def shard(tensor: torch.Tensor, kind: TpKind, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard only (what a rank loads from the checkpoint)."""
    if kind == "replicated":
        return tensor
    if kind == "gate_up":
        gate, up = torch.chunk(tensor, 2, dim=0)
        _check_divides(gate, 0, tp, kind)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    dim = _DIM[kind]
    _check_divides(tensor, dim, tp, kind)
    return torch.chunk(tensor, tp, dim=dim)[rank].contiguous()


def merge(shards: list[torch.Tensor], kind: TpKind) -> torch.Tensor:
    """The unsharded tensor from every rank's shard, rank order: the inverse of `split`."""
    if kind == "replicated":
        return shards[0]
    if kind == "gate_up":
        halves = [torch.chunk(part, 2, dim=0) for part in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=_DIM[kind])
