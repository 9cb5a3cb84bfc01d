"""torch.compile of a causal LM's decoder layers, one module at a time.

Compiling each layer (not the whole model) keeps graphs small and identical across layers, so one compiled
graph serves every layer (parameters are graph inputs), while HF's mask construction, the embedding and
our chunked logprobs stay eager. Inductor fuses RMSNorm, rotary embedding and SwiGLU, which both speeds up
the layer and saves the intermediate activations eager autograd would keep. Sequence lengths vary between
batches: after the first recompile dynamo marks them dynamic, so later lengths reuse one graph.
"""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to compile")
    return layers


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer in place (nn.Module.compile); returns how many were compiled. `backend`
    other than inductor: tests of dynamo's tracing and guards without inductor's (slow on CPU) codegen."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
