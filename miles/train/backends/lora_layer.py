"""peft's LoRA Linear with two changes, registered through peft's custom-module hook (lora.py):

1. **Compute dtype.** Adapter weights stay fp32 parameters (optimizer state and gradients stay fp32), but
   on a bf16/fp16 base the two small adapter matmuls run in the base's dtype: A and B are cast in the
   forward (cheap: they are [r, in] and [out, r]) and the cast's backward hands fp32 gradients to the
   parameters. peft runs them in fp32, which on a GPU means fp32 SIMT kernels instead of tensor cores.
   `compute_dtype` None keeps the adapter's own dtype (fp32 bases: the same ops as peft).

2. **Explicit row routing for a mixed-adapter batch.** `routing` is None (every row goes through the
   active adapters, as in peft) or a tuple of (adapter name, row count) segments covering the batch's
   rows in order. The input is split once along rows (views; backward: one cat), each segment runs its
   own adapter's GEMMs, and the deltas are joined with one cat (backward: views). peft's own mixed batch
   routes with Python index lists, which in backward become index_put / gather / zero-filled copies of the
   whole activation in every LoRA layer.

   `routing` is an attribute of the layer that the caller sets before each forward (LoraAdapters.
   mixed_batch) and that the forward reads as a Python value, so a compiled layer's graph is guarded on
   it: a graph traced under one mix of tenants is not reused for another. (peft's mixed batch passes the
   row list through forward hooks, on which dynamo installs no guard.) The routing is read when the
   forward runs: a layer recomputed later (activation checkpointing) would need it set again then.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear

Routing = tuple[tuple[str, int], ...]


def lora_delta(
    layer: PeftLoraLinear, name: str, x: torch.Tensor, compute_dtype: torch.dtype | None
) -> torch.Tensor:
    """Adapter `name`'s contribution B(A(x)) * scaling, computed in `compute_dtype` (None: A's dtype)."""
    weight_a, weight_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    dtype = compute_dtype or weight_a.dtype
    hidden = layer.lora_dropout[name](x.to(dtype))
    return F.linear(F.linear(hidden, weight_a.to(dtype)), weight_b.to(dtype)) * layer.scaling[name]


class RoutedLoraLinear(PeftLoraLinear):
    """See the module docstring. Merged, disabled and variant (DoRA, ...) layers and extra forward
    arguments take peft's own path."""

    compute_dtype: torch.dtype | None = None
    routing: Routing | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        routing = self.routing
        if routing is None:
            for name in self.active_adapters:
                if name in self.lora_A:
                    result = result + lora_delta(self, name, x, self.compute_dtype).to(result.dtype)
            return result
        parts = x.split([rows for _, rows in routing])
        deltas = [self._segment_delta(name, parts[i], result.dtype) for i, (name, _) in enumerate(routing)]
        return result + torch.cat(deltas)

    def _segment_delta(self, name: str, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.lora_A:  # this adapter leaves the layer frozen: its rows get the base alone
            return part.new_zeros((*part.shape[:-1], self.out_features), dtype=dtype)
        return lora_delta(self, name, part, self.compute_dtype).to(dtype)


def routing_of(adapter_names: list[str]) -> Routing:
    """Per-row adapter names -> consecutive runs of the same adapter, as (name, row count)."""
    runs: list[tuple[str, int]] = []
    for name in adapter_names:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    return tuple(runs)
