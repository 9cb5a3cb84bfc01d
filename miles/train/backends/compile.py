"""torch.compile of a causal LM's decoder layers, one module at a time.

Compiling each layer (not the whole model) keeps graphs small and identical across layers, so one compiled
graph serves every layer (parameters are graph inputs), while HF's mask construction, the embedding and
our chunked logprobs stay eager. Inductor fuses RMSNorm, rotary embedding and SwiGLU, which both speeds up
the layer and saves the intermediate activations eager autograd would keep. Sequence lengths vary between
batches: after the first recompile dynamo marks them dynamic, so later lengths reuse one graph.

LoRA layers read their adapters as tensors (lora_layer.py's routes), with the rank dimension marked
dynamic; one adapter's route is its parameters themselves, and dynamo keeps parameters' shapes static
unless `force_parameter_static_shapes` is off, so compiling turns it off (process-wide: the base's
parameters never change shape, so it changes nothing for them). Then one graph serves every rank.

What still compiles its own graph is structure, never a tenant: training or forward-only (grad mode), the
first layer (its input needs no gradient) or the others, one adapter (parameters) or a stacked batch
(plain tensors), the first batch size seen (static) or any other (dynamic), a rank of 1 (dynamo
specialises sizes 0 and 1). That is about 8 to 16 graphs whatever the number of tenants (8 in
bench/multi_tenant.py), which is dynamo's default recompile limit, past which a layer runs eagerly for
good; so compiling raises the limit to RECOMPILE_LIMIT.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RECOMPILE_LIMIT = 64  # graphs per decoder layer's code object: structural variants only (see above)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to compile")
    return layers


def compile_decoder_layers(model: torch.nn.Module, backend: str | Callable = "inductor") -> int:
    """Compile every decoder layer in place (nn.Module.compile); returns how many were compiled. `backend`
    other than inductor (a name or a callable): tests of dynamo's tracing and guards without inductor's (slow
    on CPU) code generation."""
    layers = decoder_layers(model)
    torch._dynamo.config.force_parameter_static_shapes = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
