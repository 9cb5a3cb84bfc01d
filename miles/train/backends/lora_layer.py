"""peft's LoRA Linear with two changes, registered through peft's custom-module hook (lora.py):

1. **Compute dtype.** Adapter weights stay fp32 parameters (optimizer state and gradients stay fp32), but
   on a bf16/fp16 base the two small adapter matmuls run in the base's dtype: A and B are cast in the
   forward (cheap: they are [r, in] and [out, r]) and the cast's backward hands fp32 gradients to the
   parameters. peft runs them in fp32, which on a GPU means fp32 SIMT kernels instead of tensor cores.
   `compute_dtype` None keeps the adapter's own dtype (fp32 bases: the same ops as peft).

2. **A mixed-adapter batch as one GEMM pair (block mask).** `mixed` is None (every row goes through the
   active adapters, as in peft) or a MixedRows: the batch's adapters in a fixed order, their ranks, and
   a [rows, sum of ranks] 0/1 mask whose row i is 1 exactly on the columns of row i's adapter. The layer
   stacks the adapters' A matrices into one [sum r, in] and their B matrices (times each one's scaling)
   into one [out, sum r], and computes (x @ A^T * mask) @ B^T: two GEMMs per layer whatever the number of
   adapters, no split or cat of the activations, and one mask built per batch for every layer. A masked
   column is exactly zero, so a row's delta is exactly its own adapter's, and in backward the mask zeroes
   the other rows' gradient into each adapter's A and B: each adapter gets the gradient it would get
   alone (in another summation order). The extra work is the other adapters' columns: sum of ranks
   instead of one rank, small next to the base's GEMMs. An adapter that this layer lacks (its tenant
   leaves the module frozen) gets zero blocks, so its rows get the base alone.

   `mixed` is an attribute of the layer that the caller sets before each forward (LoraAdapters.
   mixed_batch). A compiled layer guards on the adapters' names and ranks (Python values) and on the
   mask's shape only: a new set of adapters compiles a new graph, while another order or split of the
   rows among the same adapters reuses it, with the new mask as an input. (peft's mixed batch passes its
   row list through forward hooks, on which dynamo installs no guard.) `mixed` is read when the forward
   runs: a layer recomputed later (activation checkpointing) would need it set again then.
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


def mixed_rows(
    row_adapters: Sequence[str],
    ranks: dict[str, int],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> MixedRows:
    """The MixedRows of a batch whose row i goes through adapter `row_adapters[i]` (rows in any order).
    Blocks are in sorted name order, so a compiled graph depends on the set of adapters, not their order."""
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


def lora_delta(
    layer: PeftLoraLinear, name: str, x: torch.Tensor, compute_dtype: torch.dtype | None
) -> torch.Tensor:
    """Adapter `name`'s contribution B(A(x)) * scaling, computed in `compute_dtype` (None: A's dtype)."""
    weight_a, weight_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    dtype = compute_dtype or weight_a.dtype
    hidden = layer.lora_dropout[name](x.to(dtype))
    return F.linear(F.linear(hidden, weight_a.to(dtype)), weight_b.to(dtype)) * layer.scaling[name]


def mixed_delta(
    layer: PeftLoraLinear, mixed: MixedRows, x: torch.Tensor, compute_dtype: torch.dtype | None
) -> torch.Tensor | None:
    """Each row's own adapter's delta, for all rows at once (the block mask); None: the layer has none of
    the batch's adapters. x is [rows, ..., in]; the mask is per row."""
    present = [name for name in mixed.adapters if name in layer.lora_A]
    if not present:
        return None
    if layer.training and any(not isinstance(layer.lora_dropout[n], torch.nn.Identity) for n in present):
        raise ValueError("a mixed-adapter batch cannot apply LoRA dropout per adapter; use lora_dropout 0")
    dtype = compute_dtype or layer.lora_A[present[0]].weight.dtype
    blocks_a, blocks_b = [], []
    for name, rank in zip(mixed.adapters, mixed.ranks, strict=True):
        if name in layer.lora_A:
            blocks_a.append(layer.lora_A[name].weight.to(dtype))
            blocks_b.append(layer.lora_B[name].weight.to(dtype) * layer.scaling[name])
        else:
            blocks_a.append(x.new_zeros((rank, layer.in_features), dtype=dtype))
            blocks_b.append(x.new_zeros((layer.out_features, rank), dtype=dtype))
    hidden = F.linear(x.to(dtype), torch.cat(blocks_a))
    mask = mixed.mask.view(mixed.mask.shape[0], *([1] * (x.dim() - 2)), mixed.mask.shape[1]).to(dtype)
    return F.linear(hidden * mask, torch.cat(blocks_b, dim=1))


class RoutedLoraLinear(PeftLoraLinear):
    """See the module docstring. Merged, disabled and variant (DoRA, ...) layers and extra forward
    arguments take peft's own path."""

    compute_dtype: torch.dtype | None = None
    mixed: MixedRows | None = None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        mixed = self.mixed
        if mixed is None:
            for name in self.active_adapters:
                if name in self.lora_A:
                    result = result + lora_delta(self, name, x, self.compute_dtype).to(result.dtype)
            return result
        delta = mixed_delta(self, mixed, x, self.compute_dtype)
        return result if delta is None else result + delta.to(result.dtype)
