"""megatron-core's GPT for a Qwen3 dense shape: the parallel groups, the model, its HF checkpoint load, and
the HF-named tensors it exports, gathered over tensor parallelism one tensor at a time.

This module imports megatron-core at the top: only the megatron backend imports it, and only when it starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from safetensors import safe_open

from miles.contract.preset.model import ParallelLayout
from miles.contract.shape import ModelShape
from miles.train.megatron import shards
from miles.train.megatron.attention import SdpaCoreAttention
from miles.train.megatron.norm import SequenceParallelRMSNorm
from miles.train.megatron.weights import TensorRule, fuse, tensor_rules, unfuse

# megatron's own recompute switches for each preset value
_RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def init_parallel(layout: ParallelLayout, seed: int) -> None:
    """megatron's TP/PP/CP/DP groups over the already initialised default process group."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor,
            pipeline_model_parallel_size=layout.pipeline,
            context_parallel_size=layout.context,
        )
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)


def transformer_config(shape: ModelShape, layout: ParallelLayout, dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # what pipeline stages exchange (read only when pipeline > 1)
        # the stages exchange each micro-batch's shape: micro-batches differ in width and datum count
        variable_seq_lengths=layout.pipeline > 1,
        moe_token_dispatcher_type="alltoall",  # a dense model has no MoE; the default refuses the line above
        bf16=dtype == torch.bfloat16,
        # Tinker's losses are sums: DDP must sum gradients over data-parallel ranks, not average them
        calculate_per_token_loss=True,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **_RECOMPUTE[layout.recompute],
    )


def block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """The local (no Transformer Engine) Qwen3 block: RMSNorm (sequence-parallel capable), q/k norms,
    SwiGLU, SDPA core attention, and the final norm."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SdpaCoreAttention
    attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelRMSNorm)


def build_gpt(shape: ModelShape, layout: ParallelLayout, dtype: torch.dtype) -> GPTModel:
    gpt = GPTModel(
        config=transformer_config(shape, layout, dtype),
        transformer_layer_spec=block_spec(shape.num_layers),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    mark_tensor_parallel(gpt, shape)
    return gpt


def mark_tensor_parallel(gpt: GPTModel, shape: ModelShape) -> None:
    """Tag each TP-sharded parameter as megatron's own initialisers would have. Without initialisation
    (the weights come from the checkpoint) megatron 0.16 leaves them untagged, and then its gradient norm
    counts every sharded parameter as a TP duplicate: only TP rank 0's shards (found on CPU at TP 2)."""
    params = dict(gpt.named_parameters())
    for rule in tensor_rules(shape):
        if rule.tp_kind != "replicated":
            dim = 1 if rule.tp_kind == "row" else 0
            set_tensor_model_parallel_attributes(params[rule.mcore_name], is_parallel=True, dim=dim, stride=1)


class HfCheckpoint:
    """Reads single tensors from a HF safetensors checkpoint (one file, or sharded with an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(self.dir / "model.safetensors"), framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), "model.safetensors")

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self.dir / self.file_of[name]), framework="pt") as f:
            return f.get_tensor(name)


def _tp() -> tuple[int, int]:
    state = parallel_state
    return state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path, shape: ModelShape) -> None:
    """Every rank reads only the HF tensors of its own parameters and keeps its TP shard of each."""
    checkpoint = HfCheckpoint(model_dir)
    params = dict(model.named_parameters())
    tp, rank = _tp()
    with torch.no_grad():
        for rule in tensor_rules(shape):
            full = fuse(rule, {name: checkpoint.tensor(name) for name in rule.hf_names}, shape)
            params[rule.mcore_name].copy_(shards.shard(full, rule.tp_kind, tp, rank))


def gather_full(rule: TensorRule, local: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor of one parameter, all-gathered over the TP group (every TP rank gets it)."""
    tp, _ = _tp()
    if tp == 1 or rule.tp_kind == "replicated":
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch_dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return shards.merge(parts, rule.tp_kind)


def iter_hf_tensors(model: torch.nn.Module, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) one megatron parameter at a time: at most one unsharded tensor is alive.

    Every TP rank must drive this generator to its end (the gathers are collectives)."""
    params = dict(model.named_parameters())
    for rule in tensor_rules(shape):
        yield from unfuse(rule, gather_full(rule, params[rule.mcore_name].detach()), shape)
