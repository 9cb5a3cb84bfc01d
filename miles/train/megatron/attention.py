"""Core attention for megatron-core's local layer spec through torch's scaled_dot_product_attention.

The local spec's DotProductAttention materialises the [heads, seq, seq] score matrix (at 128K tokens that is
hundreds of GB per layer); SDPA picks a fused kernel (flash or memory-efficient on CUDA) and never does.
Batches are right-padded, so a causal mask keeps every real position exact and no padding mask is needed.

Context parallel (CP > 1): the rank holds two chunks of the sequence; its queries stay local and attend to
the keys and values all-gathered over megatron's CP group (`attend_context_parallel` in
miles.train.megatron.context).
Imported only by model.py, which the backend imports lazily (megatron-core is the `gpu` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from miles.train.megatron.context import ContextSplit, attend_context_parallel


def context_split() -> ContextSplit:
    """This rank's place in megatron's CP group."""
    return ContextSplit(
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_context_parallel_group(),
    )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention on [b, heads, s, d] (K/V with fewer heads: GQA)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


class SdpaCoreAttention(MegatronModule):
    """Causal attention on [seq, batch, heads, head_dim] (megatron's layout); returns [seq, batch, hidden].
    Under context parallelism seq is the rank's two chunks."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("SdpaCoreAttention has no dropout (training must be deterministic across ranks)")
        self.softmax_scale = softmax_scale
        self.context_parallel = config.context_parallel_size > 1

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaCoreAttention takes neither an attention bias nor packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        if self.context_parallel:
            out = attend_context_parallel(q, k, v, self.softmax_scale, context_split())
        else:
            out = attend(q, k, v, self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
