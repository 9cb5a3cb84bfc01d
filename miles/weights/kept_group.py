"""Which weight-update group a full push uses: the one the last push kept, or a fresh one; and, with
deltas on, whether it sends deltas over it (`delta_mode`, `DeltaPace`: docs/weights.md "Delta push") (pure).

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
from typing import Any, Literal

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


@dataclass(frozen=True)
class DeltaOff:
    """Why this job pushes in full from now on though deltas are on: `reason` is a metric label."""

    reason: Literal["engines_refuse", "slower"]
    detail: str


def delta_mode(enabled: bool, reuse: bool, kept: KeptGroup | None, off: DeltaOff | None) -> DeltaMode:
    """How a push over the chosen group sends: "send" deltas only over the kept group whose image was
    checked, "record" an image on any other push while deltas are on and pay."""
    if not enabled or off is not None:
        return "off"
    return "send" if reuse and kept is not None and kept.delta_ready else "record"


def fallback_reason(mode: DeltaMode, enabled: bool, off: DeltaOff | None) -> str | None:
    """Why a push with deltas on sends in full (a metric label), or None."""
    if not enabled or mode == "send":
        return None
    return off.reason if off is not None else "no_image"


SLOWER_IN_A_ROW = 2  # one slow delta push may be a cold start (kernels, pages); two are the machine


@dataclass
class DeltaPace:
    """Whether deltas pay here: each delta push's seconds against the last full (recording) push's. Where
    the wire is as fast as memory (loopback, a CPU diff), a delta push is slower than a full one
    (docs/weights.md "Measured"); after SLOWER_IN_A_ROW of them the job pushes in full."""

    full_s: float | None = None
    slower: int = 0

    def after(self, mode: DeltaMode, seconds: float) -> DeltaOff | None:
        if mode == "record":
            self.full_s = seconds
            return None
        if mode != "send" or self.full_s is None:
            return None
        self.slower = self.slower + 1 if seconds > self.full_s else 0
        if self.slower < SLOWER_IN_A_ROW:
            return None
        return DeltaOff(
            "slower",
            f"{self.slower} delta pushes in a row were slower than the last full push ({seconds:.3f} s vs "
            f"{self.full_s:.3f} s): the wire here is faster than diffing; full pushes from now on",
        )
