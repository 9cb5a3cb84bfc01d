"""peft's LoRA Linear with two changes, registered through peft's custom-module hook (lora.py):

1. **Compute dtype.** Adapter weights stay fp32 parameters (optimizer state and gradients stay fp32), but
   on a bf16/fp16 base the two small adapter matmuls run in the base's dtype: A and B are cast in the
   forward (cheap: they are [r, in] and [out, r]) and the cast's backward hands fp32 gradients to the
   parameters. peft runs them in fp32, which on a GPU means fp32 SIMT kernels instead of tensor cores.
   `compute_dtype` None keeps the adapter's own dtype (fp32 bases: the same ops as peft).

2. **Routing by tensors, not by adapter names.** The caller (LoraAdapters) sets each layer's `route`
   before a forward: a LayerRoute of three tensors, weight_a [R, in], weight_b [out, R] and scale
   [rows or 1, R], and the layer adds (x @ weight_a^T * scale) @ weight_b^T. One adapter (`single_route`)
   is its own A and B, with its scaling in a [1, r] scale. A mixed-adapter batch (`mixed_route`) stacks
   the batch's adapters' A matrices into one [sum r, in] and their B matrices into one [out, sum r], and
   the scale is the batch's block mask: row i holds its adapter's scaling on that adapter's columns and
   0 elsewhere. So a mixed batch is two GEMMs per layer whatever the number of adapters, a masked column
   is exactly zero (a row's delta is exactly its own adapter's), and in backward the mask zeroes the
   other rows' gradient into each adapter's A and B: each adapter gets the gradient it would get alone
   (in another summation order). An adapter that a layer lacks (its tenant leaves the module frozen)
   gets zero blocks there; a layer with none of the batch's adapters gets NO_DELTA (the base alone).

   Why tensors: a compiled layer guards on what its forward reads. Reading `lora_A[name]` guards on the
   name and on that adapter's parameters (their requires_grad flips with every switch of tenant), so
   each adapter or set of adapters compiled its own graph, and past torch._dynamo's recompile limit
   (8) the layer ran eagerly for good. A route's tensors are graph inputs: the graphs depend on their
   shapes and dtypes only, and the rank dimension is marked dynamic (`mark_rank_dynamic`), so one graph
   serves every adapter and every mix of adapters.

   The stacking (`mixed_route`) runs eagerly, once per layer per micro-batch; its backward hands each
   adapter its slice of the stacked gradient. `route` is read when the forward runs: a layer recomputed
   later (activation checkpointing) needs the same route set then. `route` None (never routed by
   LoraAdapters) keeps peft's own semantics: every active adapter, by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear


@dataclass(frozen=True, eq=False)
class MixedRows:
    """One mixed batch's routing, shared by every LoRA layer: see the module docstring."""

    adapters: tuple[str, ...]  # the column blocks' adapters, in order
    ranks: tuple[int, ...]  # each block's width
    mask: torch.Tensor  # [rows, sum(ranks)]: 1 on the columns of the row's adapter, else 0


@dataclass(frozen=True, eq=False)
class LayerRoute:
    """What one layer adds to its base output: (x @ weight_a^T * scale) @ weight_b^T."""

    weight_a: torch.Tensor  # [R, in]
    weight_b: torch.Tensor  # [out, R]
    scale: torch.Tensor  # [rows, R] (one scale per row) or [1, R] (every row alike)


class NoDelta:
    """The route of a layer that adds nothing: the base alone."""


NO_DELTA = NoDelta()
Route = LayerRoute | NoDelta


def mixed_rows(
    row_adapters: Sequence[str],
    ranks: dict[str, int],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> MixedRows:
    """The MixedRows of a batch whose row i goes through adapter `row_adapters[i]` (rows in any order).
    Blocks are in sorted name order."""
    if not row_adapters:
        raise ValueError("a mixed batch needs at least one row")
    unknown = sorted(set(row_adapters) - set(ranks))
    if unknown:
        raise ValueError(f"rows name adapters without a rank: {unknown} (known: {sorted(ranks)})")
    adapters = tuple(sorted(set(row_adapters)))
    widths = tuple(ranks[name] for name in adapters)
    starts = dict(zip(adapters, _offsets(widths), strict=True))
    mask = torch.zeros(len(row_adapters), sum(widths), dtype=dtype)
    for row, name in enumerate(row_adapters):
        mask[row, starts[name] : starts[name] + ranks[name]] = 1
    return MixedRows(adapters, widths, mask.to(device))


def _offsets(widths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for width in widths:
        starts.append(total)
        total += width
    return starts


def mark_rank_dynamic(route: LayerRoute) -> LayerRoute:
    """Mark the rank dimension dynamic up front, so that the first graph already serves every rank (no
    static graph first, then a dynamic one). A rank of 1 stays specialised (dynamo's 0/1 rule)."""
    torch._dynamo.maybe_mark_dynamic(route.weight_a, 0)
    torch._dynamo.maybe_mark_dynamic(route.weight_b, 1)
    torch._dynamo.maybe_mark_dynamic(route.scale, 1)
    return route


def single_route(layer: PeftLoraLinear, name: str, scale: torch.Tensor) -> Route:
    """Adapter `name` alone through `layer`; `scale` [1, r] holds its scaling (NO_DELTA: the layer lacks
    it). The parameters themselves are the route's tensors: nothing is copied."""
    if name not in layer.lora_A:
        return NO_DELTA
    _refuse_dropout(layer, [name])
    return LayerRoute(layer.lora_A[name].weight, layer.lora_B[name].weight, scale)


def mixed_route(layer: PeftLoraLinear, mixed: MixedRows, scale: torch.Tensor) -> Route:
    """The batch's adapters stacked for `layer` (zero blocks for those it lacks); `scale` is the batch's
    mask times each column's scaling, [rows, sum of ranks]."""
    present = [name for name in mixed.adapters if name in layer.lora_A]
    if not present:
        return NO_DELTA
    _refuse_dropout(layer, present)
    blocks_a, blocks_b = [], []
    for name, rank in zip(mixed.adapters, mixed.ranks, strict=True):
        if name in layer.lora_A:
            blocks_a.append(layer.lora_A[name].weight)
            blocks_b.append(layer.lora_B[name].weight)
        else:
            like = layer.lora_A[present[0]].weight
            blocks_a.append(like.new_zeros((rank, layer.in_features)))
            blocks_b.append(like.new_zeros((layer.out_features, rank)))
    return LayerRoute(torch.cat(blocks_a), torch.cat(blocks_b, dim=1), scale)


def _refuse_dropout(layer: PeftLoraLinear, names: Sequence[str]) -> None:
    if layer.training and any(not isinstance(layer.lora_dropout[n], torch.nn.Identity) for n in names):
        raise ValueError("routed LoRA layers do not apply LoRA dropout; create adapters with lora_dropout 0")


def routed_delta(x: torch.Tensor, route: LayerRoute, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """The route's delta for x [rows, ..., in], in `compute_dtype` (None: the route's dtype)."""
    dtype = compute_dtype or route.weight_a.dtype
    hidden = F.linear(x.to(dtype), route.weight_a.to(dtype))
    scale = route.scale.view(route.scale.shape[0], *([1] * (x.dim() - 2)), route.scale.shape[1])
    return F.linear(hidden * scale.to(dtype), route.weight_b.to(dtype))


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
    route: Route | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        route = self.route
        if route is None:  # not routed: peft's semantics, by name
            for name in self.active_adapters:
                if name in self.lora_A:
                    result = result + lora_delta(self, name, x, self.compute_dtype).to(result.dtype)
            return result
        if isinstance(route, NoDelta):
            return result
        return result + routed_delta(x, route, self.compute_dtype).to(result.dtype)
