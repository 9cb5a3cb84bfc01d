"""RMSNorm for megatron-core's local layer spec that also runs under sequence parallelism.

The local spec's WrappedTorchNorm (torch.nn.RMSNorm when apex is absent) refuses `sequence_parallel`,
because a plain norm does not tell megatron that its weight gradient is partial: under sequence
parallelism each TP rank normalises only its slice of the tokens. Tagging the weight `sequence_parallel`
makes megatron's finalize_model_grads sum it over the TP group, as megatron's fused norms do.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelRMSNorm:
    """Builds a torch.nn.RMSNorm (the same module as the local spec's) with its weight tagged."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused
    ) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm
