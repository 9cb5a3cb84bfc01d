"""A pipeline-parallel megatron GPT's weights in HF names on global rank 0, one megatron tensor at a time.

Each pipeline stage holds its own layers (the embedding on the first, the final norm and output layer on the
last), each in TP shards. For one megatron tensor, the first data-parallel replica's TP ranks of the stage
that owns it gather their shards to the stage's TP rank 0 (which merges them), and that rank sends the whole
tensor to global rank 0 over the pipeline group (rank 0 is the first stage's TP rank 0: it gathers its own
stage's tensors directly). Rank 0 knows each tensor's unsharded shape from the model's shape alone, so the
push can plan its buckets (`metas`) on rank 0 with no collective. At most one unsharded megatron tensor is
alive on any rank; the other data-parallel replicas hold the same weights and take no part.

The export (`iter_hf_tensors`) and the weight push (`PipelinePushSource`, the protocol of
miles.weights.sender) both walk tensors this way: every participating rank must walk the same tensors in
the same order (the gathers and the send/receive pairs are collectives).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as torch_dist
from megatron.core import parallel_state

from miles.contract.shape import ModelShape
from miles.train.backends.base import PushRole
from miles.train.megatron import shards
from miles.train.megatron.push import gather_bucket
from miles.train.megatron.stages import local_name, mcore_shape, owning_stage, stage_layers
from miles.train.megatron.weights import TensorRule, tensor_rules, unfuse
from miles.utils.buckets import TensorMeta


def push_role() -> PushRole:
    """sender: global rank 0; gatherer: the other ranks of the first data-parallel replica's first context-
    parallel rank (CP ranks hold the same weights); idle: the rest."""
    if torch_dist.get_rank() == 0:
        return "sender"
    return "gatherer" if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0 else "idle"


class PipelineWeights:
    """One rank's view of the walk (built per command: it holds no tensors of its own)."""

    def __init__(self, gpt: torch.nn.Module, shape: ModelShape) -> None:
        self.shape = shape
        self.rules = tensor_rules(shape)
        self._params = dict(gpt.named_parameters())
        self.dtype = next(iter(self._params.values())).dtype
        self._device = next(iter(self._params.values())).device
        self._pipeline = parallel_state.get_pipeline_model_parallel_world_size()
        self._stage = parallel_state.get_pipeline_model_parallel_rank()
        self._first_layer = stage_layers(shape.num_layers, self._pipeline, self._stage).start
        self._tp = parallel_state.get_tensor_model_parallel_world_size()
        self.role = push_role()

    def full_tensor(self, rule: TensorRule) -> torch.Tensor | None:
        """The unsharded megatron tensor on global rank 0; None on every other rank (after its part)."""
        if self.role == "idle":
            return None
        owner = owning_stage(rule.mcore_name, self.shape, self._pipeline)
        if owner == self._stage:
            full = self._gather_over_tp(rule)
            if owner == 0 or full is None:
                return full
            torch_dist.send(full.contiguous(), dst=self._pipeline_ranks()[0], group=self._pp_group())
            return None
        if self.role != "sender":
            return None
        full = torch.empty(mcore_shape(rule, self.shape), dtype=self.dtype, device=self._device)
        torch_dist.recv(full, src=self._pipeline_ranks()[owner], group=self._pp_group())
        return full

    def _gather_over_tp(self, rule: TensorRule) -> torch.Tensor | None:
        """The unsharded tensor on this stage's TP rank 0, None on its other TP ranks."""
        local = self._params[local_name(rule.mcore_name, self._first_layer)].detach()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if self._tp == 1 or rule.tp_kind == "replicated":
            return local if tp_rank == 0 else None
        parts = [torch.empty_like(local) for _ in range(self._tp)] if tp_rank == 0 else None
        torch_dist.gather(
            local.contiguous(),
            gather_list=parts,
            dst=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        return shards.merge(parts, rule.tp_kind) if parts is not None else None

    def _pp_group(self) -> torch_dist.ProcessGroup:
        return parallel_state.get_pipeline_model_parallel_group()

    def _pipeline_ranks(self) -> list[int]:
        return torch_dist.get_process_group_ranks(self._pp_group())


def iter_hf_tensors(gpt: torch.nn.Module, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on global rank 0, in megatron order; nothing on the other ranks, which must
    still drive the generator to its end (their part of each gather and send)."""
    weights = PipelineWeights(gpt, shape)
    for rule in weights.rules:
        full = weights.full_tensor(rule)
        if full is not None:
            yield from unfuse(rule, full, shape)


class PipelinePushSource:
    """One rank's part in the push (miles.train.backends.base.PushSource) of a pipeline-parallel GPT."""

    def __init__(self, gpt: torch.nn.Module, shape: ModelShape) -> None:
        self._weights = PipelineWeights(gpt, shape)
        self._shape = shape
        self._rule_of = {name: rule for rule in self._weights.rules for name in rule.hf_names}
        self.role = self._weights.role

    def metas(self) -> list[TensorMeta]:
        """Every HF tensor the push sends, in megatron order (shapes from the model shape: no collective)."""
        metas = []
        for rule in self._weights.rules:
            full = torch.empty(mcore_shape(rule, self._shape), dtype=self._weights.dtype, device="meta")
            metas += [TensorMeta.of(name, tensor) for name, tensor in unfuse(rule, full, self._shape)]
        return metas

    def gather_bucket(self, names: Sequence[str]) -> list[torch.Tensor] | None:
        """The bucket's HF tensors in `names` order on the sender; None elsewhere (after its part)."""
        return gather_bucket(names, self._rule_of, self._weights.full_tensor, self._shape, self.role)
