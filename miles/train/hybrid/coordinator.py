"""HybridTrainer: the driver's side of the hybrid lanes (one owner of membership, partitions and recovery).

It sends each forward_backward's shares to the live lanes (Ray actors running HybridLane), keeps the calls
of the open step so that a step a lane dies in can be recomputed on the lanes left, and changes membership
only at step boundaries: a join builds the next epoch's group and copies the core lane's state to every
member before the joiner's first step; a failed join or a death rebuilds the previous members under a
fresh epoch (epochs are never reused). The core lane (the first) is never removed here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.train.hybrid.fence import Stamp, StateDiverged
from miles.train.hybrid.group import Membership
from miles.train.hybrid.partition import LaneShare, partition
from miles.train.losses import sum_metrics
from miles.types import AdamParams, Datum, ForwardBackwardOutput, LoraSpec

log = logging.getLogger(__name__)


class MembershipError(RuntimeError):
    """A join or leave that cannot happen now (mid-step, unknown lane, the core lane)."""


class JoinFailed(RuntimeError):
    """A lane could not join; membership and state are as they were before the attempt."""


@dataclass
class Lane:
    name: str
    actor: Any  # a Ray actor handle of HybridLane
    speed: float = 1.0  # tokens/s, measured on its last non-empty share


@dataclass(frozen=True)
class FbCall:
    key: str
    data: tuple[Datum, ...]
    loss_fn: str
    loss_config: Mapping[str, float]


class HybridTrainer:
    def __init__(self, run: str, core: Lane, *, check_every: int = 1, call_timeout_s: float = 120.0) -> None:
        self.run, self.check_every, self.call_timeout_s = run, check_every, call_timeout_s
        self.lanes: list[Lane] = [core]
        self.epoch = -1
        self.pinned_speeds: dict[str, float] | None = None  # set: partition by these, not measurements
        self._store: tuple[str, int] | None = None
        self.last_command_id = ""
        self.last_join_phases: dict[str, float] = {}  # seconds per phase of the last successful join
        self._adapters: dict[str, LoraSpec] = {}
        self._open_step: dict[str, list[FbCall]] = defaultdict(list)
        self._steps: dict[str, int] = defaultdict(int)
        self._versions: dict[str, int] = defaultdict(int)
        self._dead: set[str] = set()  # lanes recovery dropped: their leave (the engine's return) is done

    @property
    def membership(self) -> Membership:
        return Membership(self.run, self.epoch, tuple(lane.name for lane in self.lanes))

    async def _call(self, calls: Sequence[Any]) -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(*calls), self.call_timeout_s))

    async def start(self) -> None:
        self._store = tuple(await self.lanes[0].actor.open_store.remote())
        await self._enter_epoch(self.lanes)

    async def _enter_epoch(self, lanes: list[Lane]) -> None:
        membership = Membership(self.run, self.epoch + 1, tuple(lane.name for lane in lanes))
        self.epoch = membership.epoch  # taken even if the join fails: a later epoch never reuses it
        await self._call([lane.actor.join_epoch.remote(membership) for lane in lanes])
        self.lanes = list(lanes)

    # ---- model keys -------------------------------------------------------------------------------

    async def create_adapter(self, key: str, spec: LoraSpec) -> None:
        await self._call([lane.actor.create_adapter.remote(key, spec) for lane in self.lanes])
        self._adapters[key] = spec
        self._steps[key], self._versions[key] = 0, 0  # the lanes' counters of a new adapter

    def _trainable(self, key: str) -> str:
        return key if self._adapters else "full"

    # ---- membership (step boundaries only) --------------------------------------------------------

    @property
    def dead_lanes(self) -> frozenset[str]:
        """Lanes recovery dropped whose leave (their engine's return) has not run yet."""
        return frozenset(self._dead)

    def at_boundary(self) -> bool:
        """No forward_backward waits for its optimizer step: membership may change now."""
        return not any(self._open_step.values())

    async def remove_adapter(self, key: str) -> None:
        """After the trainer removed the adapter from the core: gone from every lane as well (a lane lent
        now would refuse the same key created again), joiners no longer create it, nothing syncs it."""
        self._adapters.pop(key, None)
        self._open_step.pop(key, None)
        self._steps.pop(key, None)
        self._versions.pop(key, None)
        await self._call([lane.actor.remove_adapter.remote(key) for lane in self.lanes])

    async def resync(self) -> None:
        """After the core's state changed outside a step (reset, load): every lane takes it again."""
        self._require_boundary("a state resync")
        if len(self.lanes) > 1:  # the core alone holds the truth already
            await self._sync_state(check=True)

    def _require_boundary(self, what: str) -> None:
        open_keys = [key for key, calls in self._open_step.items() if calls]
        if open_keys:
            raise MembershipError(f"{what} waits for a step boundary: {open_keys} have pending gradients")

    async def join(self, lane: Lane) -> None:
        """The next epoch with `lane`; every member takes the core's state before the joiner's first step."""
        self._require_boundary(f"lane {lane.name} joining")
        before = list(self.lanes)
        clock = PhaseClock()
        try:
            assert self._store is not None
            await asyncio.wait_for(lane.actor.connect.remote(*self._store), self.call_timeout_s)
            for key, spec in self._adapters.items():
                await asyncio.wait_for(lane.actor.take_adapter.remote(key, spec), self.call_timeout_s)
            clock.lap("connect")
            await self._enter_epoch([*before, lane])
            clock.lap("group")
            await self._sync_state(check=True)
            clock.lap("state_transfer")
        except Exception as exc:
            log.warning("lane %s failed to join (%r); back to %s", lane.name, exc, [x.name for x in before])
            await self._enter_epoch(before)
            # a transfer cut short may have reached some members: the core's state is the truth again
            await self._sync_state(check=True)
            raise JoinFailed(f"lane {lane.name} could not join: {exc!r}") from exc
        self.last_join_phases = clock.phases
        log.info("lane %s joined: epoch %d, %s", lane.name, self.epoch, clock.phases)

    async def leave(self, name: str) -> None:
        self._require_boundary(f"lane {name} leaving")
        if name in self._dead:  # dropped when it died mid-step: already out of the membership
            self._dead.discard(name)
            return
        if name == self.lanes[0].name or name not in {lane.name for lane in self.lanes}:
            raise MembershipError(f"lane {name!r} cannot leave: not a hybrid lane of {self.membership}")
        await self._enter_epoch([lane for lane in self.lanes if lane.name != name])

    async def _sync_state(self, *, check: bool) -> None:
        """Every member takes the core lane's state and counters; ours follow the core's answer."""
        for key in self._adapters or ["full"]:
            counters = await self._call([lane.actor.receive_state.remote(key) for lane in self.lanes])
            if check:
                await self._call([lane.actor.check_state.remote(key) for lane in self.lanes])
            self._steps[key], self._versions[key] = counters[0]

    # ---- a step -----------------------------------------------------------------------------------

    def shares(self, data: Sequence[Datum]) -> list[LaneShare]:
        pinned = self.pinned_speeds
        speeds = [(lane.name, pinned[lane.name] if pinned else lane.speed) for lane in self.lanes]
        return partition([len(datum.model_input) for datum in data], speeds)

    async def forward_backward(
        self, key: str, data: Sequence[Datum], loss_fn: str, loss_config: Mapping[str, float]
    ) -> ForwardBackwardOutput:
        call = FbCall(key, tuple(data), loss_fn, dict(loss_config))
        self._open_step[self._trainable(key)].append(call)
        try:
            return await self._run_fb(call)
        except Exception:
            if not await self._recover(key):
                self._open_step[self._trainable(key)].remove(call)
                raise
            await self._call([lane.actor.abort_step.remote(key) for lane in self.lanes])
            return await self._replay_step(key)

    async def _run_fb(self, call: FbCall) -> ForwardBackwardOutput:
        shares = self.shares(call.data)
        results = await self._call(
            [
                lane.actor.forward_backward.remote(
                    call.key, call.data, (s.start, s.end), call.loss_fn, call.loss_config
                )
                for lane, s in zip(self.lanes, shares, strict=True)
            ]
        )
        for lane, result in zip(self.lanes, results, strict=True):
            if result.tokens_per_s is not None:
                lane.speed = result.tokens_per_s
        return merge_outputs([r.output for r in results])

    async def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        trainable = self._trainable(key)
        while True:
            stamp = Stamp(self.run, self.epoch, self._steps[trainable], self._versions[trainable])
            self.last_command_id = uuid.uuid4().hex
            calls = [
                lane.actor.optim_step.remote(key, adam, stamp, self.last_command_id) for lane in self.lanes
            ]
            results = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), self.call_timeout_s
            )
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is None:
                metrics = results[0]
                break
            if not await self._recover(key):
                raise failure
            if await self._step_was_applied(key, stamp.step):
                metrics = results[0]  # the core lane applied it: only a lane past the reduction died
                break
            await self._call([lane.actor.abort_step.remote(key) for lane in self.lanes])
            await self._replay_step(key)
        self._open_step[trainable].clear()
        self._steps[trainable] += 1
        self._versions[trainable] += 1
        if self.check_every and self._steps[trainable] % self.check_every == 0:
            await self._call([lane.actor.check_state.remote(key) for lane in self.lanes])
        return metrics

    async def _step_was_applied(self, key: str, step: int) -> bool:
        """Whether the survivors applied `step` (all of them) or none did; anything else is divergence."""
        steps = {s for s, _ in await self.counters(key)}
        if steps == {step + 1}:
            return True
        if steps == {step}:
            return False
        raise StateDiverged(f"lanes disagree after a death mid-step {step}: steps {sorted(steps)}")

    async def _recover(self, key: str) -> bool:
        """After a failed call: drop the lanes that are gone and rebuild the group of the survivors.
        False when every lane answers (the failure was the call's own: the caller sees it)."""
        alive = [lane for lane in self.lanes if await _answers(lane, min(10.0, self.call_timeout_s))]
        if len(alive) == len(self.lanes):
            return False
        if not alive or alive[0] is not self.lanes[0]:
            raise RuntimeError(f"the core lane {self.lanes[0].name} is gone: the trainer cell's rules apply")
        dead = sorted({lane.name for lane in self.lanes} - {lane.name for lane in alive})
        log.warning("lanes %s died mid-step: the step is recomputed on %s", dead, [x.name for x in alive])
        self._dead.update(dead)
        await self._enter_epoch(alive)
        return True

    async def _replay_step(self, key: str) -> ForwardBackwardOutput:
        calls = self._open_step[self._trainable(key)]
        output = None
        for call in calls:
            output = await self._run_fb(call)
        assert output is not None
        return output

    async def counters(self, key: str) -> list[tuple[int, int]]:
        return await self._call([lane.actor.counters.remote(key) for lane in self.lanes])


class PhaseClock:
    """Seconds per named phase, in order (join latency by phase: logs and bench/elastic.py)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._mark
        self._mark = now


async def _answers(lane: Lane, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(lane.actor.ping.remote(), timeout_s)
    except Exception:
        return False
    return True


def merge_outputs(parts: Sequence[ForwardBackwardOutput | None]) -> ForwardBackwardOutput:
    """The lanes' outputs in lane order: the batch's order, since shares are contiguous and ordered."""
    present = [part for part in parts if part is not None]
    return ForwardBackwardOutput(
        logprobs=[lp for part in present for lp in part.logprobs],
        elementwise_loss=[loss for part in present for loss in part.elementwise_loss],
        metrics=sum_metrics([(part.metrics, len(part.logprobs)) for part in present]),
    )
