"""The distributed optimizer's state gathered whole and cut again for another data-parallel layout: what a
megatron hybrid lane (a DP replica outside the core's DP group, issue 38) is built from, and what it gives
back when it leaves.

megatron's distributed optimizer cuts each gradient buffer over the DP ranks: a rank owns a contiguous
range of the buffer, hence of some parameters (one parameter may be split between two ranks), and holds
the fp32 main weights and Adam's moments of that range only. Buffers are padded, per bucket and per
parameter, by rules that depend on the DP size, so buffer offsets do not carry over from one layout to
another. Everything here is keyed by parameter name and by the range within the flattened parameter (this
rank's TP shard of it), which do: a layout's pieces are assembled into whole per-parameter tensors, and
another layout takes its own ranges out of them. Adam's per-parameter `step` travels with the moments.
The model's bf16 weights are not carried: they follow from the fp32 main weights (megatron's own copy),
exactly as the core's did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from miles.train.dist import DistContext
from miles.train.megatron.optim_state import optimizer_parts

FIELDS = ("param", "exp_avg", "exp_avg_sq")  # the fp32 main weights and Adam's two moments


@dataclass
class Piece:
    """This rank's range [start, end) of one parameter (flattened): its tensors (FIELDS, 1-D fp32, the
    moments absent before the first step) and Adam's step."""

    start: int
    end: int
    tensors: dict[str, torch.Tensor]
    step: float | None


@dataclass
class WholeParam:
    """One parameter's optimizer state over its whole (flattened) length."""

    tensors: dict[str, torch.Tensor]
    step: float | None


def assemble(pieces: Sequence[Piece], numel: int) -> WholeParam:
    """The whole parameter from its ranks' pieces, which must cover [0, numel) exactly once and agree on
    the step and on which fields exist (pure)."""
    ordered = sorted(pieces, key=lambda p: p.start)
    at = 0
    for piece in ordered:
        if piece.start != at or piece.end <= piece.start:
            raise ValueError(f"pieces leave a gap or overlap at {at} (next piece {piece.start}:{piece.end})")
        at = piece.end
    if at != numel:
        raise ValueError(f"pieces cover {at} of {numel} elements")
    fields = {tuple(sorted(p.tensors)) for p in ordered}
    steps = {p.step for p in ordered}
    if len(fields) != 1 or len(steps) != 1:
        raise ValueError(f"ranks disagree on the optimizer state: fields {fields}, steps {steps}")
    return WholeParam(
        {k: torch.cat([p.tensors[k] for p in ordered]) for k in ordered[0].tensors}, steps.pop()
    )


def _main_params(part) -> dict[int, torch.Tensor]:
    """id(model parameter) -> its fp32 main shard on this rank, from the optimizer's own parallel lists
    (those `_copy_main_params_to_model_params` walks). megatron-core 0.16.1's
    `_get_main_param_and_optimizer_states` pairs a parameter with its neighbour's main shard when bf16 and
    fp32 parameters share a group, so it is not used."""
    mains = {}
    pairs = [*zip(part.model_float16_groups, part.shard_fp32_from_float16_groups, strict=True)]
    pairs += [*zip(part.model_fp32_groups, part.shard_fp32_groups, strict=True)]
    for model_group, main_group in pairs:
        mains.update((id(param), main) for param, main in zip(model_group, main_group, strict=True))
    return mains


def _owned(optimizer, named: Iterable[tuple[str, torch.nn.Parameter]]):
    """(name, this rank's range, its fp32 main shard, the inner optimizer's state dict) for every
    parameter this rank owns part of."""
    parts = [(part, _main_params(part)) for part in optimizer_parts(optimizer)]
    for name, param in named:
        for part, mains in parts:
            if param not in part.model_param_gbuf_map:
                continue
            owned = part._get_model_param_range_map(param)["param"]
            if owned.size > 0:
                yield name, owned, mains[id(param)], part.optimizer.state


def local_pieces(optimizer, named: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, Piece]:
    """This rank's pieces, on the CPU."""
    pieces = {}
    for name, owned, main, state in _owned(optimizer, named):
        adam = state.get(main, {})
        tensors = {"param": main.detach().to("cpu", torch.float32).clone()}
        tensors.update(
            {k: adam[k].detach().to("cpu", torch.float32).clone() for k in FIELDS[1:] if k in adam}
        )
        step = float(adam["step"]) if "step" in adam else None
        pieces[name] = Piece(owned.start, owned.end, tensors, step)
    return pieces


def gather_whole(
    optimizer, named: Sequence[tuple[str, torch.nn.Parameter]], dp: DistContext
) -> dict[str, WholeParam] | None:
    """Every parameter's whole optimizer state on DP rank 0 (None on the others); a collective of the DP
    group. Gathered as CPU tensors: a lane's state crosses hosts on the host side anyway."""
    mine = local_pieces(optimizer, named)
    gathered: list[dict[str, Piece] | None] = [mine]
    if dp.world_size > 1:
        gathered = [None] * dp.world_size if dp.rank == 0 else []
        dst = torch_dist.get_global_rank(dp.group, 0) if dp.group is not None else 0
        torch_dist.gather_object(mine, gathered if dp.rank == 0 else None, dst=dst, group=dp.group)
    if dp.rank != 0:
        return None
    numel = {name: param.numel() for name, param in named}
    by_name: dict[str, list[Piece]] = {}
    for rank_pieces in gathered:
        for name, piece in (rank_pieces or {}).items():
            by_name.setdefault(name, []).append(piece)
    missing = sorted(set(numel) - set(by_name))
    if missing:
        raise ValueError(f"no rank holds the optimizer state of {missing[:3]}")
    return {name: assemble(by_name[name], numel[name]) for name in numel}


def load_whole(
    optimizer, ddp, named: Sequence[tuple[str, torch.nn.Parameter]], whole: Mapping[str, WholeParam]
):
    """Each rank takes its own ranges of `whole` (every rank holds it) into its main weights and Adam's
    state; the model's weights then follow from the main ones and are gathered over the DP group."""
    with torch.no_grad():
        for name, owned, main, inner in _owned(optimizer, named):
            state = whole[name]
            main.copy_(state.tensors["param"][owned.start : owned.end])
            if "exp_avg" not in state.tensors:
                inner.pop(main, None)  # before the first step: a fresh Adam, as the source had
                continue
            inner[main] = {
                "step": torch.tensor(state.step, dtype=torch.float32),
                **{
                    k: state.tensors[k][owned.start : owned.end].to(main.device, main.dtype).clone()
                    for k in ("exp_avg", "exp_avg_sq")
                },
            }
    for part in optimizer_parts(optimizer):
        part._copy_main_params_to_model_params()
    ddp.start_param_sync(force_sync=True)


def pack_whole(whole: Mapping[str, WholeParam], names: Sequence[str]) -> torch.Tensor:
    """`whole` as one flat fp32 tensor in `names`' order (each parameter's fields in FIELDS order), then
    every step: what crosses the lanes' group to a joining lane (unpack_whole reads it)."""
    chunks = [whole[n].tensors[k].reshape(-1) for n in names for k in FIELDS if k in whole[n].tensors]
    steps = [whole[n].step if whole[n].step is not None else -1.0 for n in names]
    return torch.cat([*chunks, torch.tensor(steps, dtype=torch.float32)])


def packed_numel(numels: Sequence[int], with_moments: bool) -> int:
    return sum(numels) * (len(FIELDS) if with_moments else 1) + len(numels)


def unpack_whole(
    packed: torch.Tensor, names: Sequence[str], numels: Sequence[int], with_moments: bool
) -> dict[str, WholeParam]:
    """pack_whole's tensor back into per-parameter state (`with_moments`: Adam has stepped)."""
    if packed.numel() != packed_numel(numels, with_moments):
        raise ValueError(f"a packed state of {packed.numel()} elements for {len(names)} parameters")
    fields = FIELDS if with_moments else FIELDS[:1]
    whole, offset = {}, 0
    steps = packed[-len(names) :].tolist()
    for name, numel, step in zip(names, numels, steps, strict=True):
        tensors = {}
        for field in fields:
            tensors[field] = packed[offset : offset + numel].clone()
            offset += numel
        whole[name] = WholeParam(tensors, None if step < 0 else step)
    return whole
