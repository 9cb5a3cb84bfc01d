"""Core attention for megatron-core's local layer spec through torch's scaled_dot_product_attention.

The local spec's DotProductAttention materialises the [heads, seq, seq] score matrix (at 128K tokens that is
hundreds of GB per layer); SDPA picks a fused kernel (flash or memory-efficient on CUDA) and never does.
Batches are right-padded, so a causal mask keeps every real position exact and no padding mask is needed.

Context parallel (CP > 1; miles.train.megatron.context): the rank holds two chunks of the sequence. Its keys
and values are all-gathered over the CP group into sequence order (the queries stay local), and each local
query chunk attends causally to the keys up to its own end: a lower-right causal bias (query i of a chunk
ending at e sees keys < e - chunk + i + 1), which torch dispatches to the flash kernel on CUDA (its causal
flag is lower-right) or to the memory-efficient one, never to a materialised mask where either runs. This
is how Llama 3 trained at long context; it costs one all-gather of K and V per layer and their reduce-
scatter in the backward, and holds one layer's whole-sequence K and V (GQA: KV heads only).
Imported only by model.py, which the backend imports lazily (megatron-core is the `gpu` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention.bias import causal_lower_right

from miles.train.megatron.context import ContextSplit, chunk_ends, gather_kv


def context_split() -> ContextSplit:
    """This rank's place in megatron's CP group."""
    return ContextSplit(
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_context_parallel_group(),
    )


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, mask: object = None
) -> torch.Tensor:
    """Causal attention on [b, heads, s, d] (K/V with fewer heads: GQA); `mask`: a causal bias whose
    alignment differs from SDPA's own upper-left one."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def attend_context_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, split: ContextSplit
) -> torch.Tensor:
    """[b, heads, s_local, d] queries of the rank's two chunks against every rank's keys and values (local
    [b, kv_heads, s_local, d], gathered here): each chunk sees the keys before its end, causally."""
    keys, values = (gather_kv(t.permute(2, 0, 1, 3), split).permute(1, 2, 0, 3) for t in (k, v))
    chunk = q.shape[2] // 2
    ends = chunk_ends(keys.shape[2], split.size, split.rank)
    outs = [
        attend(part, keys[:, :, :end], values[:, :, :end], scale, causal_lower_right(chunk, end))
        for part, end in zip(q.split(chunk, dim=2), ends, strict=True)
    ]
    return torch.cat(outs, dim=2)


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
