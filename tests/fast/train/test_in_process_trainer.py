"""InProcessTrainer: commands run one at a time off the event loop, even when a caller gives up waiting."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from dataclasses import dataclass, field

import pytest

from miles.train.commands import ForwardBackward, TrainerCommand
from miles.train.in_process import InProcessTrainer
from miles.types import ForwardBackwardOutput


@dataclass
class Bench:
    """Stands in for a backend: records which command runs when."""

    events: list[str] = field(default_factory=list)
    running: int = 0
    most_at_once: int = 0


@dataclass(frozen=True)
class Work(TrainerCommand[str]):
    label: str
    release: threading.Event

    def run(self, backend: Bench) -> str:  # type: ignore[override]
        backend.running += 1
        backend.most_at_once = max(backend.most_at_once, backend.running)
        backend.events.append(f"start {self.label}")
        assert self.release.wait(10), "never released"
        backend.events.append(f"end {self.label}")
        backend.running -= 1
        return self.label


async def wait_for_event(bench: Bench, event: str) -> None:
    for _ in range(500):
        if event in bench.events:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{event!r} did not happen: {bench.events}")


async def test_a_cancelled_caller_keeps_the_trainer_until_its_command_ends() -> None:
    bench = Bench()
    trainer = InProcessTrainer(bench)  # type: ignore[arg-type]
    first_release, second_release = threading.Event(), threading.Event()
    first = asyncio.create_task(trainer.run(Work("first", first_release)))
    await wait_for_event(bench, "start first")  # the event loop is free while the command runs
    first.cancel()  # an execution timeout: the caller stops waiting, the computation goes on
    with pytest.raises(asyncio.CancelledError):
        await first

    second_release.set()
    second = asyncio.create_task(trainer.run(Work("second", second_release)))
    await asyncio.sleep(0.2)
    assert bench.events == ["start first"]  # second waits for the still-running first
    first_release.set()
    assert await second == "second"
    assert bench.events == ["start first", "end first", "start second", "end second"]
    assert bench.most_at_once == 1


class SlowForward:
    """Stands in for a backend whose forward_backward takes 20 ms."""

    def forward_backward(self, key, data, loss_fn, loss_config, forward_only=False) -> ForwardBackwardOutput:
        time.sleep(0.02)
        return ForwardBackwardOutput(logprobs=[], elementwise_loss=[], metrics={"loss:sum": 0.0})


async def test_a_forward_backward_reports_how_long_the_backend_computed_it() -> None:
    trainer = InProcessTrainer(SlowForward())  # type: ignore[arg-type]
    started = time.perf_counter_ns()
    out = await trainer.run(ForwardBackward("k", [], "cross_entropy", {}))
    assert 20_000_000 <= out.compute_ns <= time.perf_counter_ns() - started


@dataclass(frozen=True)
class Fails(TrainerCommand[str]):
    def run(self, backend: Bench) -> str:  # type: ignore[override]
        raise ValueError("bad batch")


@dataclass(frozen=True)
class ThreadName(TrainerCommand[str]):
    def run(self, backend: Bench) -> str:  # type: ignore[override]
        return threading.current_thread().name


async def test_a_failing_command_raises_in_the_caller_and_the_next_one_runs() -> None:
    trainer = InProcessTrainer(Bench())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad batch"):
        await trainer.run(Fails())
    assert await trainer.run(ThreadName()) == "miles-trainer"  # the same thread serves on
    trainer.close()


async def test_close_ends_the_thread_after_the_queued_commands_and_refuses_new_ones() -> None:
    bench = Bench()
    trainer = InProcessTrainer(bench)  # type: ignore[arg-type]
    release = threading.Event()
    queued = asyncio.create_task(trainer.run(Work("queued", release)))
    await wait_for_event(bench, "start queued")
    thread = trainer._thread
    assert thread is not None
    trainer.close()
    release.set()
    assert await queued == "queued"  # closing does not drop a command already on the queue
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        await trainer.run(ThreadName())


def test_the_thread_ends_once_the_trainer_is_garbage_collected() -> None:
    trainer = InProcessTrainer(Bench())  # type: ignore[arg-type]
    assert asyncio.run(trainer.run(ThreadName())) == "miles-trainer"
    thread = trainer._thread
    assert thread is not None
    del trainer
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()  # it held neither the trainer nor its backend


def test_a_command_outliving_its_event_loop_does_not_stop_the_trainer() -> None:
    bench = Bench()
    trainer = InProcessTrainer(bench)  # type: ignore[arg-type]
    release = threading.Event()

    async def start_and_leave() -> asyncio.Task[str]:
        orphan = asyncio.create_task(trainer.run(Work("orphan", release)))
        await wait_for_event(bench, "start orphan")
        return orphan  # never awaited: asyncio.run cancels it and closes the loop

    asyncio.run(start_and_leave())
    release.set()  # the command ends after its loop closed: its result has nowhere to go
    later = asyncio.run(asyncio.wait_for(trainer.run(ThreadName()), 5))
    assert later == "miles-trainer"  # the thread survived it and serves a later loop
    assert bench.events == ["start orphan", "end orphan"]
    trainer.close()


async def test_wait_closed_returns_once_the_command_in_flight_has_ended() -> None:
    bench = Bench()
    trainer = InProcessTrainer(bench)  # type: ignore[arg-type]
    release = threading.Event()
    running = asyncio.create_task(trainer.run(Work("save", release)))
    await wait_for_event(bench, "start save")
    trainer.close()
    assert not await trainer.wait_closed(timeout_s=0.2)  # the command still runs: not closed yet
    release.set()
    assert await trainer.wait_closed(timeout_s=5)
    assert bench.events == ["start save", "end save"]
    assert await running == "save"
