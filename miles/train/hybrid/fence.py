"""Delivery fencing: which gradient contributions a step may sum. Pure.

Every contribution is a `Delivery` stamped (run, membership epoch, step, state version, lane, nonce). The
fence of one step accepts exactly one delivery per member of the step's epoch, stamped with that step's
run, epoch, step and version and a nonce never seen before; anything else is rejected with the reason.
Once every member has delivered the step is RELEASED (its summed gradient may be applied); a RELEASED or
ABORTED step accepts nothing more, so a late or replayed record can never undo a release.

States and transitions (the only ones allowed are in TRANSITIONS):

    OPEN --deliver--> OPEN        a fresh delivery from a member that had not delivered
    OPEN --release--> RELEASED    every member delivered
    OPEN --abort----> ABORTED     a member died, a delivery was rejected, the step was cancelled
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class StepState(enum.Enum):
    OPEN = "open"
    RELEASED = "released"
    ABORTED = "aborted"


TRANSITIONS: dict[tuple[StepState, str], StepState] = {
    (StepState.OPEN, "deliver"): StepState.OPEN,
    (StepState.OPEN, "release"): StepState.RELEASED,
    (StepState.OPEN, "abort"): StepState.ABORTED,
}


class FenceError(RuntimeError):
    """A transition the table does not allow (a bug in the caller, not a bad delivery)."""


class DeliveryRejected(RuntimeError):
    """The step's fence rejected a delivery: nothing was summed or applied, on any lane."""


class StateDiverged(RuntimeError):
    """The lanes' state digests differ: a bug, never silently trained on."""


@dataclass(frozen=True)
class Stamp:
    """What a step expects: the run, the membership epoch, the optimizer step and the state version."""

    run: str
    epoch: int
    step: int
    version: int


@dataclass(frozen=True)
class Delivery:
    stamp: Stamp
    lane: str
    nonce: str  # unique per delivery: the step command's id and the lane


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str


def check(
    expected: Stamp,
    members: frozenset[str],
    delivered: dict[str, str],
    seen_nonces: RecentNonces,
    delivery: Delivery,
) -> Verdict:
    """Why `delivery` may or may not join the step expecting `expected` (first failing rule wins)."""
    got = delivery.stamp
    rules = (
        (got.run == expected.run, f"foreign run {got.run!r} (this run is {expected.run!r})"),
        (got.epoch == expected.epoch, f"stale membership epoch {got.epoch} (current {expected.epoch})"),
        (delivery.lane in members, f"lane {delivery.lane!r} is not a member of epoch {expected.epoch}"),
        (got.step == expected.step, f"wrong step {got.step} (expected {expected.step})"),
        (got.version == expected.version, f"wrong state version {got.version} (expected {expected.version})"),
        (delivery.nonce not in seen_nonces, f"replayed delivery {delivery.nonce!r}"),
        (delivery.lane not in delivered, f"duplicate delivery from lane {delivery.lane!r}"),
    )
    for ok, reason in rules:
        if not ok:
            return Verdict(False, reason)
    return Verdict(True, "accepted")


class RecentNonces:
    """The last `capacity` accepted nonces (a set with its oldest entries dropped, so a long run stays
    bounded). An older nonce replayed still fails the step and version checks unless restamped."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._order: deque[str] = deque()
        self._members: set[str] = set()
        self.capacity = capacity

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._members

    def add(self, nonce: str) -> None:
        if nonce in self._members:
            return
        self._order.append(nonce)
        self._members.add(nonce)
        if len(self._order) > self.capacity:
            self._members.discard(self._order.popleft())


@dataclass
class StepFence:
    expected: Stamp
    members: frozenset[str]
    seen_nonces: RecentNonces = field(default_factory=RecentNonces)  # shared across steps: replays later too
    state: StepState = StepState.OPEN
    delivered: dict[str, str] = field(default_factory=dict)  # lane -> nonce
    rejections: list[str] = field(default_factory=list)

    def _move(self, event: str) -> None:
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            raise FenceError(f"step {self.expected.step}: {event} is not allowed when {self.state.value}")
        self.state = target

    def offer(self, delivery: Delivery) -> Verdict:
        if self.state is not StepState.OPEN:
            verdict = Verdict(False, f"step {self.expected.step} already {self.state.value}")
        else:
            verdict = check(self.expected, self.members, self.delivered, self.seen_nonces, delivery)
        if verdict.accepted:
            self._move("deliver")
            self.delivered[delivery.lane] = delivery.nonce
            self.seen_nonces.add(delivery.nonce)
        else:
            self.rejections.append(f"{delivery.lane}: {verdict.reason}")
        return verdict

    @property
    def complete(self) -> bool:
        return set(self.delivered) == self.members

    def release(self) -> None:
        if not self.complete or self.rejections:
            missing = sorted(self.members - set(self.delivered))
            raise FenceError(
                f"step {self.expected.step} cannot release: missing {missing}, {self.rejections}"
            )
        self._move("release")

    def abort(self) -> None:
        self._move("abort")
