"""The weight push's view of a megatron rank: HF-named tensors gathered over TP one bucket at a time.

The driver plans buckets over HF names from `metas()`, which needs no collective (the shapes follow from the
local shards). Then, for every bucket, each TP rank of the first data-parallel replica sends its shard of
each megatron tensor the bucket touches to TP rank 0 (a gather over the TP group), which merges the shards,
unfuses QKV (per KV group) and fc1 (gate, up) into HF tensors and keeps the bucket's. Only that replica
takes part: its TP rank 0 is global rank 0, the push's sender; the other replicas hold the same weights, and
so do the context-parallel ranks of a replica (only CP rank 0 takes part).

No state outlives a bucket: a megatron tensor whose HF pieces fall into two buckets (q in one, k and v in
the next) is gathered for each, at most one extra tensor per bucket boundary. So besides its own shards a
rank holds at most one bucket's unsharded tensors (TP rank 0) or nothing (the others).

Every participating rank must call `gather_bucket` for every bucket, in the same order (the gathers are
collectives); the sender (miles.weights.sender) runs the Broadcast command on all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state

from miles.contract.shape import ModelShape
from miles.train.backends.base import PushRole
from miles.train.megatron import shards
from miles.train.megatron.weights import TensorRule, tensor_rules, unfuse
from miles.utils.buckets import TensorMeta


def push_role(tp_rank: int, dp_rank: int) -> PushRole:
    """The sender is global rank 0 (it joins the engines' group), the gatherers the other TP ranks of DP
    replica 0, and the rest idle. `dp_rank`: the rank in the data x context parallel group (CP ranks hold
    the same weights: only the first of the first replica takes part)."""
    if dp_rank != 0:
        return "idle"
    return "sender" if tp_rank == 0 else "gatherer"


def full_shape(rule: TensorRule, local: torch.Size, tp: int) -> tuple[int, ...]:
    """The unsharded shape of a megatron tensor from one TP rank's shard."""
    shape = list(local)
    if rule.tp_kind != "replicated":
        shape[1 if rule.tp_kind == "row" else 0] *= tp
    return tuple(shape)


def gather_bucket(
    names: Sequence[str],
    rule_of: dict[str, TensorRule],
    full_tensor: Callable[[TensorRule], torch.Tensor | None],
    shape: ModelShape,
    role: PushRole,
) -> list[torch.Tensor] | None:
    """A bucket's HF tensors in `names` order on the sender, None elsewhere: each megatron tensor the
    bucket touches is made whole once (`full_tensor`: a collective every rank of the push joins, in
    megatron order; None where this rank is not the one it is made whole on), then unfused."""
    unknown = [name for name in names if name not in rule_of]
    if unknown:  # every rank sees the same plan, so every rank refuses it before any gather
        raise ValueError(f"the bucket plan names tensors this model does not have: {unknown[:5]}")
    wanted = set(names)
    found: dict[str, torch.Tensor] = {}
    for rule in dict.fromkeys(rule_of[name] for name in names):  # megatron tensors, in order
        full = full_tensor(rule)
        if full is not None:
            found.update((n, t) for n, t in unfuse(rule, full, shape) if n in wanted)
    return [found[name] for name in names] if role == "sender" else None


class TpPushSource:
    """One rank's part in the push of a megatron GPT's weights (built per command: it holds no tensors)."""

    def __init__(self, gpt: torch.nn.Module, shape: ModelShape) -> None:
        self._shape = shape
        self._params = dict(gpt.named_parameters())
        self._rules = tensor_rules(shape)
        self._rule_of = {name: rule for rule in self._rules for name in rule.hf_names}
        self._tp = parallel_state.get_tensor_model_parallel_world_size()
        self.role = push_role(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
        )

    def metas(self) -> list[TensorMeta]:
        """Every HF tensor the push sends, in megatron order (shapes only: unfused on the meta device)."""
        metas = []
        for rule in self._rules:
            local = self._params[rule.mcore_name]
            full = torch.empty(full_shape(rule, local.shape, self._tp), dtype=local.dtype, device="meta")
            metas += [TensorMeta.of(name, tensor) for name, tensor in unfuse(rule, full, self._shape)]
        return metas

    def gather_bucket(self, names: Sequence[str]) -> list[torch.Tensor] | None:
        """The bucket's HF tensors in `names` order on the sender; None on a gatherer (after its part)."""
        return gather_bucket(names, self._rule_of, self._gather, self._shape, self.role)

    def _gather(self, rule: TensorRule) -> torch.Tensor | None:
        """The unsharded tensor on TP rank 0, None on the other TP ranks (which send their shard)."""
        local = self._params[rule.mcore_name].detach()
        if self._tp == 1 or rule.tp_kind == "replicated":
            return local if self.role == "sender" else None
        parts = [torch.empty_like(local) for _ in range(self._tp)] if self.role == "sender" else None
        torch_dist.gather(
            local.contiguous(),
            gather_list=parts,
            dst=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        return shards.merge(parts, rule.tp_kind) if parts is not None else None
