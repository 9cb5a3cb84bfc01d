"""Colocated jobs: the trainer and the engines take turns on the same GPUs (docs/colocation.md).

One gate per model decides who holds the GPUs. Training commands run in TRAINING, when the engines have
released their memory (SGLang's release_memory_occupation); samples run in SAMPLING, when the trainer has
moved its optimizer state and gradients off the GPU (as the preset asks) and the engines have taken their
memory back and hold the trainer's latest weights. A caller of one side waits while the other side has
work in flight, and once it waits, new work of the other side waits behind it, so neither side starves.
The switch itself runs outside the gate's lock, by the first caller that finds the GPUs idle.

    SAMPLING --> SWITCHING --> TRAINING --> SWITCHING --> SAMPLING
                     \\--> UNSETTLED (a switch failed) --> SWITCHING (the next caller of either side)

A failed switch leaves the GPUs UNSETTLED: no engine is routed to (the update bracket marks none ready),
and the next caller switches from scratch, whichever side it is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles.contract import events
from miles.errors import IllegalTransition, UnavailableError
from miles.rollout.cell_state import CellState
from miles.rollout.controller import InferenceController
from miles.train.commands import PrepareForSampling, PrepareForTraining, TrainerClient
from miles.utils.step_clock import StepClock
from miles.weights.ipc_push import EngineStep

log = logging.getLogger(__name__)


class GpuPhase(enum.Enum):
    SAMPLING = "sampling"
    TRAINING = "training"
    SWITCHING = "switching"
    UNSETTLED = "unsettled"


TRANSITIONS: dict[GpuPhase, frozenset[GpuPhase]] = {
    GpuPhase.SAMPLING: frozenset({GpuPhase.SWITCHING}),
    GpuPhase.TRAINING: frozenset({GpuPhase.SWITCHING}),
    GpuPhase.UNSETTLED: frozenset({GpuPhase.SWITCHING}),
    GpuPhase.SWITCHING: frozenset({GpuPhase.SAMPLING, GpuPhase.TRAINING, GpuPhase.UNSETTLED}),
}

SIDES = (GpuPhase.SAMPLING, GpuPhase.TRAINING)
# moves the GPUs to the given side; the seconds of its steps, if it times them (the `colocation` event's)
Switch = Callable[[GpuPhase], Awaitable[dict[str, float] | None]]


def _other(side: GpuPhase) -> GpuPhase:
    return GpuPhase.TRAINING if side is GpuPhase.SAMPLING else GpuPhase.SAMPLING


class ColocationGate:
    """`async with gate.hold(GpuPhase.TRAINING): ...` runs its body while the GPUs are the trainer's."""

    def __init__(self, switch: Switch, *, sampling_wait_s: float) -> None:
        self._switch = switch
        self._sampling_wait_s = sampling_wait_s
        self._phase = GpuPhase.SAMPLING  # bring-up ends with the engines holding the first weights
        self._active = {side: 0 for side in SIDES}
        self._waiting = {side: 0 for side in SIDES}
        self._wanted: GpuPhase | None = None  # the side that waits for the other to drain
        self._changed = asyncio.Condition()
        self.last_failure: str | None = None  # the last failed switch, while the GPUs stay unsettled
        self.switches = {side: 0 for side in SIDES}
        self.switch_seconds = {side: 0.0 for side in SIDES}

    @property
    def phase(self) -> GpuPhase:
        return self._phase

    def _move(self, new: GpuPhase) -> None:
        if new not in TRANSITIONS[self._phase]:
            raise IllegalTransition(f"colocated GPUs: {self._phase.value} -> {new.value}")
        log.info("colocated GPUs: %s -> %s", self._phase.value, new.value)
        self._phase = new

    def _may_enter(self, side: GpuPhase) -> bool:
        return self._phase is side and self._wanted in (None, side)

    def _may_switch(self, side: GpuPhase) -> bool:
        settled = self._phase is not GpuPhase.SWITCHING and self._phase is not side
        return settled and self._active[_other(side)] == 0

    @contextlib.asynccontextmanager
    async def hold(self, side: GpuPhase) -> AsyncIterator[None]:
        """The body runs while the GPUs are `side`'s. Sampling waits at most `sampling_wait_s` for its turn
        (a switch it runs itself is not cut short: a half-done switch helps nobody)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._sampling_wait_s if side is GpuPhase.SAMPLING else None
        try:
            must_switch = await self._wait_turn(side, deadline)
        except TimeoutError:
            raise UnavailableError(
                f"the GPUs stayed with the trainer for {self._sampling_wait_s:.0f} s (colocated job: the "
                "engines sample between training steps); retry when the training step is done"
            ) from None
        if must_switch:
            await self._run_switch(side)  # counts the caller in, or raises the switch's failure
        try:
            yield
        finally:
            async with self._changed:
                self._active[side] -= 1
                self._changed.notify_all()

    async def _wait_turn(self, side: GpuPhase, deadline: float | None) -> bool:
        """Until the caller may run on `side` (counted in: False) or must switch to it (SWITCHING: True)."""
        loop = asyncio.get_running_loop()
        async with self._changed:
            self._waiting[side] += 1
            try:
                while True:
                    if self._may_enter(side):
                        self._active[side] += 1
                        return False
                    if self._may_switch(side):
                        self._move(GpuPhase.SWITCHING)
                        return True
                    if self._wanted is None and self._phase is not side:
                        self._wanted = side  # the other side's new work waits behind this caller
                    remaining = None if deadline is None else deadline - loop.time()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(self._changed.wait(), remaining)
            finally:
                self._waiting[side] -= 1
                if self._waiting[side] == 0 and self._wanted is side:
                    self._wanted = None  # the last waiter left (timed out, cancelled, or its turn came)
                    self._changed.notify_all()

    async def _run_switch(self, side: GpuPhase) -> None:
        """Holding SWITCHING: move the GPUs to `side`, and count the caller in (or raise the failure)."""
        started = time.monotonic()
        settled = GpuPhase.UNSETTLED
        steps: dict[str, float] | None = None
        try:
            steps = await self._switch(side)
            settled = side
            self.last_failure = None
        except BaseException as exc:
            self.last_failure = f"switch to {side.value} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            seconds = time.monotonic() - started
            async with self._changed:
                self._move(settled)
                if self._wanted is side or settled is GpuPhase.UNSETTLED:
                    self._wanted = None
                if settled is side:
                    self._active[side] += 1
                    self.switches[side] += 1
                    self.switch_seconds[side] += seconds
                self._changed.notify_all()
            timed = {"steps": {name: round(s, 4) for name, s in steps.items()}} if steps else {}
            events.record("colocation", phase=settled.value, seconds=round(seconds, 4), **timed)

    def problem(self) -> str | None:
        """Why the GPUs are unsettled (the last switch failed), or None."""
        if self._phase is GpuPhase.UNSETTLED and self.last_failure:
            return f"colocated GPUs unsettled: {self.last_failure}; the next request switches again"
        return None

    def status(self) -> dict[str, object]:
        return {
            "phase": self._phase.value,
            "sampling_in_flight": self._active[GpuPhase.SAMPLING],
            "training_in_flight": self._active[GpuPhase.TRAINING],
            "switches": {side.value: n for side, n in self.switches.items()},
        }


# ---- the switch: what moves when the GPUs change sides ---------------------------------------------


@dataclass(frozen=True)
class ColocationPlan:
    """The preset's `colocate:` as the runtime needs it (miles.contract.preset.colocate)."""

    engine_release: tuple[str, ...]  # what the engines release while the trainer works
    trainer_offload: tuple[str, ...]  # what the trainer moves to host memory while the engines sample


PushToEngines = Callable[[EngineStep | None], Awaitable[Any]]  # the trainer's weights -> serving engines


class ColocatedGpus:
    """The gate's `switch`: release the engines and reload the trainer's state for training; offload the
    trainer's state, resume the engines and push them the trainer's weights for sampling. An engine that
    refuses a release or a resume is killed (its process, and the memory it holds, gone) and respawned by
    the health checker once the GPUs are the engines' again; the others carry on.

    What each engine process has released is tracked here, so that no tag is released or resumed twice
    (SGLang treats an empty tag list as every tag, and refuses to resume what is not released) after a
    switch that failed half-way; a respawned engine is a new process and has released nothing."""

    def __init__(
        self,
        plan: ColocationPlan,
        inference: InferenceController,
        trainer: TrainerClient,
        push: PushToEngines | None,
    ) -> None:
        self.plan = plan
        self._inference = inference
        self._trainer = trainer
        self._push = push  # None: the engines' weights never change (LoRA: adapters load from disk)
        self._released: dict[tuple[int, int], frozenset[str]] = {}  # (cell, its process) -> tags

    async def __call__(self, side: GpuPhase) -> dict[str, float]:
        """Move the GPUs to `side`; the seconds of each step (release, trainer; trainer, resume, push)."""
        clock = StepClock()
        if side is GpuPhase.TRAINING:
            await self._to_training(clock)
        else:
            await self._to_sampling(clock)
        return clock.steps

    def _tags(self, cell: Any) -> frozenset[str]:
        return self._released.get((cell.index, cell.starts), frozenset())

    async def _to_training(self, clock: StepClock) -> None:
        serving = [cell for cell in self._inference.cells if cell.serving]
        with clock("release"):
            await asyncio.gather(*(self._release(cell) for cell in serving))
        if self.plan.trainer_offload:  # else nothing was moved: no round trip to the trainer
            with clock("trainer"):
                await self._trainer.run(PrepareForTraining())

    async def _release(self, cell: Any) -> None:
        cell.mark_pending()  # never routed to from here on, whatever the engine answers
        held = self._tags(cell)
        tags = [tag for tag in self.plan.engine_release if tag not in held]
        try:
            if tags:
                await cell.client.release_memory_occupation(tags)
            cell.transition(CellState.RELEASED)
        except Exception as exc:
            self._inference.fail_engine(cell, f"release_memory_occupation failed: {exc}")
            return
        self._released[(cell.index, cell.starts)] = held | set(tags)

    async def _resume(self, cell: Any, tags: tuple[str, ...]) -> None:
        """Resume those of `tags` `cell` released; one that refuses is killed."""
        held = self._tags(cell)
        wanted = [tag for tag in tags if tag in held]
        try:
            if wanted:
                await cell.client.resume_memory_occupation(wanted)
        except Exception as exc:
            self._inference.fail_engine(cell, f"resume_memory_occupation failed: {exc}")
            return
        self._released[(cell.index, cell.starts)] = held - set(wanted)
        if cell.released:
            cell.transition(CellState.PENDING_WEIGHTS)

    async def _to_sampling(self, clock: StepClock) -> None:
        if self.plan.trainer_offload:
            with clock("trainer"):
                await self._trainer.run(PrepareForSampling(self.plan.trainer_offload))
        # with a push, the KV cache comes back after it: the push has that memory to work in
        later = ("kv_cache",) if self._push is not None else ()
        first = tuple(tag for tag in self.plan.engine_release if tag not in later)
        released = [cell for cell in self._inference.cells if cell.released]
        with clock("resume"):
            await asyncio.gather(*(self._resume(cell, first) for cell in released))
        if not any(cell.serving for cell in self._inference.cells):
            raise UnavailableError(
                "no engine could take its GPU memory back for sampling (see the engine cells' problems); "
                "they are being respawned, retry in a minute"
            )

        async def resume_rest(cell: Any) -> None:
            await self._resume(cell, later)  # a refusal kills the engine: the bracket skips it

        if self._push is not None:
            with clock("push"):  # its own steps are in its `push` event
                await self._push(resume_rest)
        else:  # nothing to push: the engines that resumed are ready again
            async with self._inference.weight_update(base_weights=False):
                pass
