"""Which weight-update group a full push uses: the one the last push kept, or a fresh one (pure).

Creating and destroying a group is most of a push's fixed cost on NCCL (communicator set-up and
shutdown: 0.19 s + 0.50 s of a 0.70 s push of Qwen3-0.6B over NVLink, docs/gpu.md). A successful push
therefore leaves its group joined, and the next push reuses it when, and only when, its members are the
same processes: the same engine cells, none restarted since (a respawned engine is a new process that
never joined), in the same order (an engine's rank is its place), and the trainer still holds the group
(a restarted trainer does not). Anything else gets a fresh group, and the old one is torn down on every
member that still has it. A failed push tears its group down everywhere (miles.weights.push), so a group
is only ever kept by a push that every member finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles.utils.buckets import TensorMeta
from miles.weights.delta_image import DeltaMode
from miles.weights.sender import GroupSpec

# One engine process: the cell, how many processes the cell has started (a respawn counts one up), and
# the client object the cell made for that process.
MemberId = tuple[int, int, int]


@dataclass(frozen=True)
class KeptGroup:
    spec: GroupSpec
    members: tuple[MemberId, ...]
    # What the group's last push sent, in its buckets, and the (bucket bytes, flattened) it planned them
    # with: the next push plans from it without asking the trainer first (the trainer's Join checks it
    # still holds; docs/weights.md "Control calls").
    buckets: tuple[tuple[TensorMeta, ...], ...] = ()
    planned_with: tuple[int, bool] = (0, True)
    # The trainer holds an image of what these engines hold, checked by digest: the next push over this
    # group may send deltas against it (docs/weights.md "Delta push").
    delta_ready: bool = False

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(meta for bucket in self.buckets for meta in bucket)


def member_ids(engines: Sequence[Any]) -> tuple[MemberId, ...]:
    """The identity of each engine process a push targets, in rank order."""
    return tuple((id(cell), int(getattr(cell, "starts", 0)), id(cell.client)) for cell in engines)


def reusable(
    kept: KeptGroup | None, members: tuple[MemberId, ...], backend: str, trainer_kept: str | None
) -> bool:
    """Whether `kept` joins exactly these engine processes and this trainer over `backend`."""
    return (
        kept is not None
        and kept.members == members
        and kept.spec.backend == backend
        and trainer_kept == kept.spec.group_name
    )


def layout_known(kept: KeptGroup | None, members: tuple[MemberId, ...], backend: str) -> bool:
    """Whether a push may plan from `kept`'s tensors and go straight to the trainer's Join: the same
    engine processes over the same backend (the trainer's side is checked by its Join)."""
    return (
        kept is not None and bool(kept.buckets) and kept.members == members and kept.spec.backend == backend
    )


def delta_mode(enabled: bool, reuse: bool, kept: KeptGroup | None, refusal: str | None) -> DeltaMode:
    """How a push over the chosen group sends: "send" deltas only over the kept group whose image was
    checked, "record" an image on any other push while deltas are on and the engines take them."""
    if not enabled or refusal is not None:
        return "off"
    return "send" if reuse and kept is not None and kept.delta_ready else "record"


def fallback_reason(mode: DeltaMode, enabled: bool, refusal: str | None) -> str | None:
    """Why a push with deltas on sends in full (a metric label), or None."""
    if not enabled or mode == "send":
        return None
    return "engines_refuse" if refusal is not None else "no_image"
