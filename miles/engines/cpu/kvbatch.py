"""The KV cache of a batch of sequences of different lengths: one HF DynamicCache, left-padded.

Every row's tokens end at the last column, so one decode step appends one column for all rows. A 2-D
attention mask (1 = a real token of that row) keeps the padding out of attention, and each row carries its
own position ids (a row's first real token is position 0 however much padding precedes it): a sequence
decoded in a batch sees exactly what it would see alone. Rows joining a batch are padded on the left to the
longer side; finished rows are dropped by index, and columns that became padding in every row are cut.

Tensor work only, run on the model thread by the step (step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PAD_ID = 0  # any valid id: padded columns are masked out of attention and never read


@dataclass
class KVBatch:
    cache: Any  # transformers.DynamicCache of full-attention layers, tensors [rows, heads, columns, dim]
    mask: torch.Tensor  # [rows, columns] long: 1 where the column holds a real token of the row
    next_pos: torch.Tensor  # [rows] long: the position id of each row's next token

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input ids, attention mask, position ids


def left_padded(seqs: list[list[int]], device: torch.device) -> Inputs:
    """Input ids, attention mask and position ids [rows, longest] of `seqs`, padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def step_inputs(kv: KVBatch, tokens: list[int]) -> Inputs:
    """Input ids [rows, 1], the mask with the new column, and position ids for one decode step."""
    device = kv.mask.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    mask = torch.cat([kv.mask, torch.ones_like(kv.mask[:, :1])], dim=1)
    return ids, mask, kv.next_pos[:, None]


def merge(a: KVBatch | None, b: KVBatch | None) -> KVBatch | None:
    """`a`'s rows then `b`'s, the shorter side padded on the left (masked zeros)."""
    if a is None or b is None:
        return a if b is None else b
    width = max(a.mask.shape[1], b.mask.shape[1])
    for left, right in zip(a.cache.layers, b.cache.layers, strict=True):
        left.keys = torch.cat([_pad_columns(left.keys, width), _pad_columns(right.keys, width)])
        left.values = torch.cat([_pad_columns(left.values, width), _pad_columns(right.values, width)])
    mask = torch.cat([_pad_mask(a.mask, width), _pad_mask(b.mask, width)])
    return KVBatch(a.cache, mask, torch.cat([a.next_pos, b.next_pos]))


def select(kv: KVBatch, keep: list[int]) -> KVBatch | None:
    """Only the rows `keep` (in that order), without the columns that are now padding in every row."""
    if not keep:
        return None
    if keep != list(range(kv.rows)):
        index = torch.tensor(keep, dtype=torch.long, device=kv.mask.device)
        kv.cache.batch_select_indices(index)
        kv = KVBatch(kv.cache, kv.mask[index], kv.next_pos[index])
    lead = int(kv.mask.any(dim=0).int().argmax())  # the first column some row still uses
    if lead == 0:
        return kv
    for layer in kv.cache.layers:
        layer.keys = layer.keys[..., lead:, :]
        layer.values = layer.values[..., lead:, :]
    return KVBatch(kv.cache, kv.mask[:, lead:], kv.next_pos)


def _pad_columns(states: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(states, (0, 0, width - states.shape[-2], 0))


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(mask, (width - mask.shape[1], 0))
