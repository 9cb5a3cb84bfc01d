"""A decode batch in fixed slots: every row's KV cache in buffers whose shape and address do not change from
one decode step to the next, so the step can be replayed as a CUDA graph (graphs.py).

The dynamic batch (kvbatch.py) grows its cache by one column a step and re-cuts it whenever a row ends or
joins: new shapes, new memory, nothing a graph could replay. Here each layer's keys and values are one
tensor [slots, kv_heads, capacity, head_dim], allocated once. Rows occupy slots (`row_slots`, in the
scheduler's row order); every row's tokens end at column `write - 1`, left-padded as in kvbatch.py, and a
decode step writes column `write` for every slot. A boolean mask [slots, capacity] keeps unused columns and
empty slots out of attention (masked columns hold zeros or an earlier row's finite values: never NaN,
which a zero attention weight would not cancel).

A row that ends frees its slot (its mask row cleared); a row that joins takes a free slot, its prefilled
cache copied in so that it ends at `write - 1` (the batch shifted right first when the joiner is wider).
Only when there is no free slot or no free column is the batch copied into larger buffers (`regrow`),
which a graph must then be captured for again.

Tensor work only, run on the model thread by the step (step.py); it runs the same on CPU, where the tests
check it against the dynamic batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.engines.cpu.kvbatch import PAD_ID, KVBatch

CAPACITY_QUANTUM = 128  # columns are allocated in multiples of this: fewer distinct shapes, fewer regrows
# Columns reserved ahead at most: a longer max_new_tokens regrows by this much at a time (a copy and a new
# capture every 512 steps), rather than holding memory for tokens that an early stop never decodes.
HORIZON_LIMIT = 512


@dataclass(eq=False)
class SlotBatch:
    keys: list[torch.Tensor]  # per layer [slots, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    mask: torch.Tensor  # [slots, capacity] bool: the column holds a real token of the slot's row
    next_pos: torch.Tensor  # [slots] long: the position id of each slot's next token (0 in free slots)
    occupied: torch.Tensor  # [slots] long: 1 where a row holds the slot
    column: torch.Tensor  # [1] long: `write` on the device (what a graph reads)
    write: int  # the column the next decode step writes
    row_slots: list[int]  # the slot of each row, in the scheduler's row order
    graph: Any = None  # the decode step captured for these buffers (graphs.DecodeGraph), once there is one
    eager_steps: int = 0  # decode steps run eagerly on these buffers (the first one warms a capture up)

    @property
    def rows(self) -> int:
        return len(self.row_slots)

    @property
    def slots(self) -> int:
        return int(self.mask.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[1])

    def free_slots(self) -> list[int]:
        taken = set(self.row_slots)
        return [slot for slot in range(self.slots) if slot not in taken]


def slot_count(rows: int) -> int:
    """Slots for `rows`, as SGLang buckets its graphs' batch sizes: a power of two up to 8, then a multiple
    of 8 (a few rows joining keep the buffers; never twice the memory the rows need)."""
    if rows <= 8:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 8) * 8


def capacity_for(columns: int) -> int:
    return -(-columns // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def from_kv(kv: KVBatch, horizon: int) -> SlotBatch:
    """The prefilled batch `kv` in new slots, with room for `horizon` more tokens (at most HORIZON_LIMIT)."""
    width = int(kv.mask.shape[1])
    layers = kv.cache.layers
    batch = _allocate(
        [layer.keys for layer in layers],
        [layer.values for layer in layers],
        slot_count(kv.rows),
        capacity_for(width + _reserve(horizon)),
    )
    _set_write(batch, width)
    assert place(batch, kv), "fresh slots hold the batch they were sized for"
    return batch


def select(batch: SlotBatch, keep: list[int]) -> SlotBatch | None:
    """Only the rows `keep`, in that order; the others' slots are freed. None when no row is left."""
    if not keep:
        return None
    row_slots = [batch.row_slots[i] for i in keep]
    freed = sorted(set(batch.row_slots) - set(row_slots))
    if freed:
        batch.mask[freed] = False
        batch.occupied[freed] = 0
        batch.next_pos[freed] = 0
    batch.row_slots = row_slots
    return batch


def place(batch: SlotBatch, joined: KVBatch) -> bool:
    """Copy the prefilled rows of `joined` into free slots, after the batch's rows; False (nothing changed)
    when they do not fit: too few free slots, or no column left to decode into."""
    width = int(joined.mask.shape[1])
    free = batch.free_slots()
    shift = max(0, width - batch.write)
    if len(free) < joined.rows or batch.write + shift >= batch.capacity:
        return False
    if shift:
        _shift(batch, shift)
    targets = free[: joined.rows]
    index = torch.tensor(targets, dtype=torch.long, device=batch.mask.device)
    start = batch.write - width
    for keys, values, layer in zip(batch.keys, batch.values, joined.cache.layers, strict=True):
        keys[index, :, start : batch.write] = layer.keys
        values[index, :, start : batch.write] = layer.values
    batch.mask[index] = False
    batch.mask[index, start : batch.write] = joined.mask.bool()
    batch.next_pos[index] = joined.next_pos
    batch.occupied[index] = 1
    batch.row_slots = batch.row_slots + targets
    return True


def make_room(batch: SlotBatch) -> bool:
    """Whether column `write` is free for the next decode step, after moving the rows left over columns that
    no row uses any more. False: the batch must regrow."""
    if batch.write < batch.capacity:
        return True
    lead = _first_used_column(batch)
    if lead == 0:
        return False
    _shift(batch, -lead)
    return True


def join(batch: SlotBatch, joined: KVBatch, horizon: int) -> SlotBatch:
    """`batch` with the prefilled rows of `joined` after its rows: in place when they fit, else in new
    buffers with slots for all and room for `horizon` more tokens."""
    if place(batch, joined):
        return batch
    width = batch.write - _first_used_column(batch)
    grown = regrow(batch, batch.rows + joined.rows, horizon, width=max(width, int(joined.mask.shape[1])))
    assert place(grown, joined), "regrown slots hold the rows they were sized for"
    return grown


def regrow(batch: SlotBatch, rows: int, horizon: int, *, width: int = 0) -> SlotBatch:
    """The batch's rows (compacted into the first slots, same order) in new buffers with slots for `rows`
    rows, columns for rows `width` tokens wide (at least the rows' own) and room for `horizon` more tokens
    (at most HORIZON_LIMIT)."""
    lead = _first_used_column(batch)
    used = batch.write - lead
    grown = _allocate(
        batch.keys,
        batch.values,
        slot_count(max(rows, batch.rows)),
        capacity_for(max(used, width) + _reserve(horizon)),
    )
    _set_write(grown, used)
    index = torch.tensor(batch.row_slots, dtype=torch.long, device=batch.mask.device)
    count = len(batch.row_slots)
    for new, old in zip(grown.keys + grown.values, batch.keys + batch.values, strict=True):
        new[:count, :, :used] = old[index, :, lead : batch.write]
    grown.mask[:count, :used] = batch.mask[index, lead : batch.write]
    grown.next_pos[:count] = batch.next_pos[index]
    grown.occupied[:count] = 1
    grown.row_slots = list(range(count))
    return grown


def _reserve(horizon: int) -> int:
    return max(min(horizon, HORIZON_LIMIT), 1)


def step_ids(batch: SlotBatch, tokens: list[int]) -> torch.Tensor:
    """Input ids [slots, 1] on the host: each row's pending token in its slot, PAD_ID in the free ones."""
    ids = [PAD_ID] * batch.slots
    for slot, token in zip(batch.row_slots, tokens, strict=True):
        ids[slot] = token
    return torch.tensor(ids, dtype=torch.long)[:, None]


def open_column(batch: SlotBatch) -> None:
    """Before a decode step: column `write` takes part in attention for every slot (a free slot then
    attends to its own token: never a row with nothing to attend to, whose softmax would be NaN)."""
    batch.mask[:, batch.write] = True


def advance(batch: SlotBatch) -> None:
    """After a decode step: every row's next position and the write column move on, in place (a captured
    graph reads these very tensors). A free slot's position stays 0: a model with a table of positions
    is never asked for one past it."""
    batch.next_pos += batch.occupied
    _set_write(batch, batch.write + 1)


class SlotCache:
    """What a Hugging Face attention layer calls on its cache during a decode step over a SlotBatch: write
    the step's keys and values at the batch's write column, return the layer's whole buffers. Duck-typed,
    not a transformers `Cache`: the mask is passed ready-made (4-D), so nothing else of the cache API is
    read, and no transformers version's cache internals are relied upon."""

    def __init__(self, batch: SlotBatch) -> None:
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.batch.keys[layer_idx], self.batch.values[layer_idx]
        keys.index_copy_(2, self.batch.column, key_states)
        values.index_copy_(2, self.batch.column, value_states)
        return keys, values


def _allocate(
    keys_like: list[torch.Tensor], values_like: list[torch.Tensor], slots: int, capacity: int
) -> SlotBatch:
    """Zeroed buffers with the layers, heads, head size, dtype and device of `*_like` ([rows, heads, columns,
    head_dim] each)."""

    def zeros(like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros((slots, like.shape[1], capacity, like.shape[3]))

    mask = keys_like[0].new_zeros((slots, capacity), dtype=torch.bool)
    return SlotBatch(
        keys=[zeros(k) for k in keys_like],
        values=[zeros(v) for v in values_like],
        mask=mask,
        next_pos=mask.new_zeros(slots, dtype=torch.long),
        occupied=mask.new_zeros(slots, dtype=torch.long),
        column=mask.new_zeros(1, dtype=torch.long),
        write=0,
        row_slots=[],
    )


def _set_write(batch: SlotBatch, write: int) -> None:
    batch.write = write
    batch.column.fill_(write)


def _first_used_column(batch: SlotBatch) -> int:
    used = batch.mask[batch.row_slots].any(dim=0)
    return int(used.int().argmax())


def _shift(batch: SlotBatch, by: int) -> None:
    """Move every slot's used columns [0, write) by `by` columns (right when positive), in place."""
    lo, hi = (0, batch.write) if by > 0 else (-by, batch.write)
    for buffer in batch.keys + batch.values:
        buffer[:, :, lo + by : hi + by] = buffer[:, :, lo:hi].clone()
    batch.mask[:, lo + by : hi + by] = batch.mask[:, lo:hi].clone()
    if by > 0:
        batch.mask[:, :by] = False
    else:
        batch.mask[:, hi + by : hi] = False
    _set_write(batch, batch.write + by)
