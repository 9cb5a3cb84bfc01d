"""The colocation gate: training and sampling take turns on the GPUs, neither starves, a failed switch
leaves the GPUs unsettled and the next caller switches again (miles/runtime/colocation.py)."""

from __future__ import annotations

import asyncio

import pytest

from miles.errors import IllegalTransition, UnavailableError
from miles.runtime.colocation import TRANSITIONS, ColocationGate, GpuPhase

S, T = GpuPhase.SAMPLING, GpuPhase.TRAINING


class Switches:
    """The gate's switch, recording each move; `fail` makes the next one raise."""

    def __init__(self) -> None:
        self.moves: list[GpuPhase] = []
        self.fail = False
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, side: GpuPhase) -> None:
        await self.release.wait()
        if self.fail:
            self.fail = False
            raise RuntimeError("release_memory_occupation refused")
        self.moves.append(side)


async def _use(gate: ColocationGate, side: GpuPhase, log: list[str], name: str, hold: asyncio.Event) -> None:
    async with gate.hold(side):
        log.append(f"{name}+")
        await hold.wait()
        log.append(f"{name}-")


async def test_same_side_shares_without_switching() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=5)
    done = asyncio.Event()
    log: list[str] = []
    tasks = [asyncio.create_task(_use(gate, S, log, f"s{i}", done)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert log == ["s0+", "s1+", "s2+"]  # all three in at once, no switch (bring-up ends sampling)
    done.set()
    await asyncio.gather(*tasks)
    assert switches.moves == []


async def test_training_waits_for_samples_then_switches_once() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=5)
    sample_done, train_done = asyncio.Event(), asyncio.Event()
    log: list[str] = []
    sample = asyncio.create_task(_use(gate, S, log, "s", sample_done))
    await asyncio.sleep(0.01)
    trains = [asyncio.create_task(_use(gate, T, log, f"t{i}", train_done)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert log == ["s+"] and gate.phase is S  # the trainer waits for the sample in flight
    sample_done.set()
    await asyncio.sleep(0.01)
    assert log == ["s+", "s-", "t0+", "t1+"]
    assert switches.moves == [T] and gate.phase is T
    assert gate.status() == {
        "phase": "training",
        "sampling_in_flight": 0,
        "training_in_flight": 2,
        "switches": {"sampling": 0, "training": 1},
    }
    train_done.set()
    await asyncio.gather(sample, *trains)
    assert gate.status()["training_in_flight"] == 0 and gate.switch_seconds[T] > 0


async def test_a_waiting_side_is_not_starved_by_new_arrivals_of_the_other() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=5)
    first, later = asyncio.Event(), asyncio.Event()
    log: list[str] = []
    s1 = asyncio.create_task(_use(gate, S, log, "s1", first))
    await asyncio.sleep(0.01)
    t = asyncio.create_task(_use(gate, T, log, "t", later))
    await asyncio.sleep(0.01)
    s2 = asyncio.create_task(_use(gate, S, log, "s2", later))  # arrives after the trainer asked
    await asyncio.sleep(0.01)
    assert log == ["s1+"]  # s2 waits behind the trainer instead of joining the sampling side
    first.set()
    await asyncio.sleep(0.01)
    assert log == ["s1+", "s1-", "t+"]
    later.set()
    await asyncio.gather(s1, t, s2)
    assert log[-2:] == ["s2+", "s2-"] and switches.moves == [T, S]


async def test_failed_switch_unsettles_and_the_next_caller_switches_again() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=5)
    switches.fail = True
    with pytest.raises(RuntimeError, match="refused"):
        async with gate.hold(T):
            pass
    assert gate.phase is GpuPhase.UNSETTLED
    assert gate.problem() == (
        "colocated GPUs unsettled: switch to training failed: RuntimeError: release_memory_occupation "
        "refused; the next request switches again"
    )
    async with gate.hold(S):  # the sampling side switches from scratch, too
        assert gate.phase is S and gate.problem() is None
    assert switches.moves == [S]
    assert gate.status()["sampling_in_flight"] == 0


async def test_sampling_waits_bounded_then_503() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=0.05)
    busy = asyncio.Event()
    log: list[str] = []
    train = asyncio.create_task(_use(gate, T, log, "t", busy))
    await asyncio.sleep(0.01)
    with pytest.raises(UnavailableError, match="stayed with the trainer"):
        async with gate.hold(S):
            pass
    # the timed-out waiter left no claim behind: new training enters at once, no switch
    async with asyncio.timeout(1), gate.hold(T):
        pass
    busy.set()
    await train
    async with gate.hold(S):
        pass
    assert switches.moves == [T, S]


async def test_a_slow_switch_is_not_cut_by_the_sampling_wait_bound() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=0.05)
    async with gate.hold(T):
        pass
    switches.release.clear()
    sampling = asyncio.create_task(gate.hold(S).__aenter__())
    await asyncio.sleep(0.2)  # four times the wait bound, inside the sampler's own switch
    assert not sampling.done() and gate.phase is GpuPhase.SWITCHING
    switches.release.set()
    await sampling
    assert gate.phase is S and switches.moves == [T, S]


async def test_cancelled_switch_is_unsettled_not_stuck() -> None:
    switches = Switches()
    switches.release.clear()
    gate = ColocationGate(switches, sampling_wait_s=5)
    task = asyncio.create_task(gate.hold(T).__aenter__())
    await asyncio.sleep(0.01)
    assert gate.phase is GpuPhase.SWITCHING
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.phase is GpuPhase.UNSETTLED
    switches.release.set()
    async with gate.hold(T):
        assert switches.moves == [T]


def test_transitions_table_is_closed() -> None:
    for source, targets in TRANSITIONS.items():
        assert targets, source
        assert GpuPhase.SWITCHING in targets or source is GpuPhase.SWITCHING
    gate = ColocationGate(Switches(), sampling_wait_s=1)
    with pytest.raises(IllegalTransition):
        gate._move(GpuPhase.TRAINING)  # sampling -> training skips the switch


async def test_one_of_two_waiting_samplers_giving_up_keeps_the_other_ones_claim() -> None:
    switches = Switches()
    gate = ColocationGate(switches, sampling_wait_s=5)
    busy, later = asyncio.Event(), asyncio.Event()
    log: list[str] = []
    train = asyncio.create_task(_use(gate, T, log, "t", busy))
    await asyncio.sleep(0.01)
    quitter = asyncio.create_task(gate.hold(S).__aenter__())
    stayer = asyncio.create_task(_use(gate, S, log, "s", later))
    await asyncio.sleep(0.01)
    quitter.cancel()
    await asyncio.gather(quitter, return_exceptions=True)
    trainer2 = asyncio.create_task(_use(gate, T, log, "t2", later))
    await asyncio.sleep(0.01)
    assert log == ["t+"]  # t2 still queues behind the sampler that stayed
    busy.set()
    later.set()
    await asyncio.gather(train, stayer, trainer2)
    assert log.index("s+") < log.index("t2+")
