"""Which pipeline stage holds which megatron tensor, under which name and whole shape (pure: no megatron).

Each of `pipeline` stages holds `num_layers / pipeline` consecutive decoder layers, which megatron names
from 0 on every stage (`decoder.layers.0` of stage 1 is the model's layer `num_layers / pipeline`); the
first stage also holds the embedding, the last the final norm and the output layer. A tied model's last
stage (when it is not also the first) keeps its own copy of the embedding as its output layer, as megatron
does, loaded from the same HF tensor.
"""

from __future__ import annotations

import dataclasses

from miles.contract.shape import ModelShape
from miles.train.megatron.weights import TensorRule, tensor_rules

LAYER_PREFIX = "decoder.layers."


def stage_layers(num_layers: int, pipeline: int, stage: int) -> range:
    """The model's layers that pipeline stage `stage` holds (equal, contiguous shares)."""
    per_stage = num_layers // pipeline
    return range(stage * per_stage, (stage + 1) * per_stage)


def local_name(name: str, first_layer: int) -> str:
    """A whole-model megatron name as the stage whose first layer is `first_layer` names it."""
    if not name.startswith(LAYER_PREFIX):
        return name
    index, rest = name[len(LAYER_PREFIX) :].split(".", 1)
    return f"{LAYER_PREFIX}{int(index) - first_layer}.{rest}"


def stage_rules(shape: ModelShape, pipeline: int, stage: int) -> list[TensorRule]:
    """The tensors of one stage under its own megatron names (what its GPTModel's parameters are)."""
    layers = stage_layers(shape.num_layers, pipeline, stage)
    rules = [
        dataclasses.replace(rule, mcore_name=local_name(rule.mcore_name, layers.start))
        for rule in tensor_rules(shape, layers)
    ]
    if shape.tie_embeddings and pipeline > 1 and stage == pipeline - 1:
        rules.append(TensorRule("output_layer.weight", ("model.embed_tokens.weight",), "none", "vocab"))
    return rules


def owning_stage(mcore_name: str, shape: ModelShape, pipeline: int) -> int:
    """The pipeline stage that holds a megatron tensor (by its whole-model name)."""
    if mcore_name.startswith("embedding."):
        return 0
    if mcore_name.startswith(LAYER_PREFIX):
        layer = int(mcore_name[len(LAYER_PREFIX) :].split(".", 1)[0])
        return layer // (shape.num_layers // pipeline)
    return pipeline - 1  # the final norm and the output layer


def mcore_shape(rule: TensorRule, shape: ModelShape) -> tuple[int, ...]:
    """The unsharded shape of a megatron tensor from the model's shape alone (rank 0 plans the push's
    buckets with it, for tensors that other stages hold)."""
    name, hidden, head = rule.mcore_name, shape.hidden_size, shape.head_dim
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (head,)
    if name.endswith("layernorm.weight"):
        return (hidden,)
    if rule.tp_kind == "vocab":
        return (shape.vocab_size, hidden)
    if name.endswith("linear_qkv.weight"):
        return ((shape.num_heads + 2 * shape.num_kv_heads) * head, hidden)
    if name.endswith("linear_proj.weight"):
        return (hidden, shape.num_heads * head)
    if name.endswith("linear_fc1.weight"):
        return (2 * shape.ffn_hidden_size, hidden)
    if name.endswith("linear_fc2.weight"):
        return (hidden, shape.ffn_hidden_size)
    raise ValueError(f"no shape rule for megatron tensor {name!r}")
