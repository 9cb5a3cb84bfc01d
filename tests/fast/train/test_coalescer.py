"""ForwardBackwardCoalescer over a real in-process trainer: what it merges, what it keeps apart, and that
each model's results equal the model run alone (backends/multi_tenant.py's maths is test_multi_tenant.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from miles.errors import UserError
from miles.train.backends.base import MergesForwardBackward, MergesOptimSteps
from miles.train.coalescer import (
    DEFAULT_ACTIVE_S,
    ForwardBackwardCoalescer,
    ForwardBackwardMany,
    OptimStepMany,
)
from miles.train.commands import ForwardBackward, OptimStep, TrainerCommand
from miles.train.errors import TrainerUnavailableError
from miles.train.in_process import InProcessTrainer
from miles.types import AdamParams, ForwardBackwardOutput

from .test_multi_tenant import TENANTS, _assert_same_grads, _assert_same_output, _backend, _requests


class RecordingTrainer(InProcessTrainer):
    """The real in-process trainer, remembering which commands it ran."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.commands: list[TrainerCommand[Any]] = []

    async def run(self, command):
        self.commands.append(command)
        return await super().run(command)


def _keys(command: TrainerCommand[Any]) -> list[str]:
    if isinstance(command, ForwardBackwardMany):
        return [r.key for r in command.requests]
    assert isinstance(command, ForwardBackward)
    return [command.key]


async def test_concurrent_models_share_one_command_and_match_each_alone(tiny_model_dir: Path) -> None:
    alone, trainer = _backend(tiny_model_dir), RecordingTrainer(_backend(tiny_model_dir))
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=5.0, models=lambda: len(TENANTS))
    requests = _requests()
    got = await asyncio.gather(*(coalescer.submit(r) for r in requests))
    # every model had a request waiting: sent at once (not after the 5 s window), as one command
    assert [_keys(c) for c in trainer.commands] == [[r.key for r in requests]]
    assert (coalescer.stats.requests, coalescer.stats.commands, coalescer.stats.largest) == (4, 1, 4)
    assert all(result.compute_ns > 0 for result in got)  # the gateway's stage timings
    for result, request in zip(got, requests, strict=True):
        _assert_same_output(result, request.run(alone))
        _assert_same_grads(trainer.backend, alone, request.key)


async def test_one_model_keeps_its_order_and_a_bad_batch_fails_alone(tiny_model_dir: Path) -> None:
    """Two requests of model a: the second goes in the next command, after the first; b's bad batch fails
    b only."""
    alone, trainer = _backend(tiny_model_dir), RecordingTrainer(_backend(tiny_model_dir))
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=0.05)
    first, bad, third = _requests()[:3]
    second = _requests(seed=7)[0]
    bad = ForwardBackward(bad.key, bad.data, "ppo", {"clip_low_threshold": 2.0})
    results = await asyncio.gather(
        *(coalescer.submit(r) for r in (first, second, bad, third)), return_exceptions=True
    )
    assert [_keys(c) for c in trainer.commands] == [[first.key, bad.key, third.key], [second.key]]
    assert isinstance(results[2], UserError) and "clip_low_threshold" in str(results[2])
    _assert_same_output(results[0], first.run(alone))
    _assert_same_output(results[1], second.run(alone))  # after the first: gradients accumulated in order
    _assert_same_output(results[3], third.run(alone))
    for key in (first.key, third.key):
        _assert_same_grads(trainer.backend, alone, key)


async def test_window_zero_sends_each_request_alone(tiny_model_dir: Path) -> None:
    trainer = RecordingTrainer(_backend(tiny_model_dir))
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=0.0, models=lambda: len(TENANTS))
    requests = _requests()
    await asyncio.gather(*(coalescer.submit(r) for r in requests))
    assert sorted(type(c).__name__ for c in trainer.commands) == ["ForwardBackward"] * 4
    assert coalescer.stats.largest == 1


async def test_forward_only_waits_for_a_command_of_its_kind_and_a_cancelled_request_is_dropped(
    tiny_model_dir: Path,
) -> None:
    trainer = RecordingTrainer(_backend(tiny_model_dir))
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=0.2)
    a, b, c = _requests()[:3]
    only = _requests(seed=3, forward_only=True)[3]
    dropped = asyncio.ensure_future(coalescer.submit(c))
    await asyncio.sleep(0)
    dropped.cancel()
    await asyncio.gather(coalescer.submit(a), coalescer.submit(only), coalescer.submit(b))
    assert [_keys(cmd) for cmd in trainer.commands] == [[a.key, b.key], [only.key]]
    with pytest.raises(asyncio.CancelledError):
        await dropped


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        ForwardBackwardCoalescer(InProcessTrainer(None).run, window_s=-1)  # type: ignore[arg-type]


async def test_a_command_that_fails_as_a_whole_fails_every_request_in_it(tiny_model_dir: Path) -> None:
    """No alive trainer: both merged requests get the error, and the coalescer serves the next ones."""
    trainer = RecordingTrainer(_backend(tiny_model_dir))
    alive = False

    async def run(command):
        if not alive:
            raise TrainerUnavailableError(command.name, "trainer cell 0 errored")
        return await trainer.run(command)

    coalescer = ForwardBackwardCoalescer(run, window_s=5.0, models=lambda: 2)
    a, b = _requests()[:2]
    failed = await asyncio.gather(coalescer.submit(a), coalescer.submit(b), return_exceptions=True)
    assert all(isinstance(f, TrainerUnavailableError) for f in failed)
    alive = True
    await asyncio.wait_for(asyncio.gather(coalescer.submit(a), coalescer.submit(b)), timeout=60)
    assert [_keys(c) for c in trainer.commands] == [[a.key, b.key]]


class Clock:
    """The coalescer's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_only_models_active_in_the_last_second_are_waited_for(tiny_model_dir: Path) -> None:
    """Four models loaded, window 600 s: a model alone with idle neighbours goes at once (waiting for every
    loaded model would hold it the whole window), one with an active neighbour waits for it."""
    trainer, clock = RecordingTrainer(_backend(tiny_model_dir)), Clock()
    models = lambda: len(TENANTS)  # noqa: E731
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=600.0, models=models, clock=clock)
    a, b = _requests()[:2]
    a_again, b_again = _requests(seed=7)[:2]
    await asyncio.wait_for(coalescer.submit(a), timeout=60)  # nobody else ever sent: no companion
    assert coalescer.active_models() == {a.key}

    clock.now = 0.5  # a sent half a second ago: b waits for it
    waiting = asyncio.ensure_future(coalescer.submit(b))
    await asyncio.sleep(0.2)
    assert not waiting.done() and coalescer.active_models() == {a.key, b.key}
    await asyncio.wait_for(asyncio.gather(waiting, coalescer.submit(a_again)), timeout=60)
    assert coalescer.stats.waited_s >= 0.2  # b's wait, accounted

    clock.now = 0.5 + DEFAULT_ACTIVE_S + 0.1  # a has been silent for longer than a second: b goes alone
    assert coalescer.active_models() == set()
    await asyncio.wait_for(coalescer.submit(b_again), timeout=60)
    assert [_keys(c) for c in trainer.commands] == [[a.key], [b.key, a.key], [b.key]]


def test_active_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="active_s"):
        ForwardBackwardCoalescer(InProcessTrainer(None).run, active_s=0)  # type: ignore[arg-type]


async def test_a_released_model_is_no_longer_waited_for(tiny_model_dir: Path) -> None:
    """b and c wait for a (active) in a 600 s window; a is released: they go at once."""
    trainer, clock = RecordingTrainer(_backend(tiny_model_dir)), Clock()
    loaded = {key for key, *_ in TENANTS[:3]}
    coalescer = ForwardBackwardCoalescer(trainer.run, window_s=600.0, models=lambda: len(loaded), clock=clock)
    a, b, c = _requests()[:3]
    b_again, c_again = _requests(seed=7)[1:3]
    await asyncio.wait_for(asyncio.gather(*(coalescer.submit(r) for r in (a, b, c))), timeout=60)
    waiting_b = asyncio.ensure_future(coalescer.submit(b_again))
    waiting_c = asyncio.ensure_future(coalescer.submit(c_again))
    await asyncio.sleep(0.2)
    assert not waiting_b.done()  # for a, active
    loaded.discard(a.key)
    coalescer.forget(a.key)
    await asyncio.wait_for(asyncio.gather(waiting_b, waiting_c), timeout=60)
    assert coalescer.active_models() == {b.key, c.key}
    assert [_keys(cmd) for cmd in trainer.commands] == [[a.key, b.key, c.key], [b.key, c.key]]


async def test_a_model_just_answered_after_a_long_command_is_waited_for(tiny_model_dir: Path) -> None:
    """a and b's merged pass takes 5 s (a big batch): both sent longer than a second ago, but both were
    just answered, so a's next request waits for b's and they share the next pass again."""
    trainer, clock = RecordingTrainer(_backend(tiny_model_dir)), Clock()

    async def long_pass(command):
        clock.now += 5.0
        return await trainer.run(command)

    coalescer = ForwardBackwardCoalescer(long_pass, window_s=600.0, clock=clock)
    a, b = _requests()[:2]
    a_again, b_again = _requests(seed=7)[:2]
    await asyncio.wait_for(asyncio.gather(coalescer.submit(a), coalescer.submit(b)), timeout=60)
    waiting = asyncio.ensure_future(coalescer.submit(a_again))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # for b, answered just now
    await asyncio.wait_for(asyncio.gather(waiting, coalescer.submit(b_again)), timeout=60)
    assert [_keys(c) for c in trainer.commands] == [[a.key, b.key], [a.key, b.key]]


class OneAtATime:
    """A backend with neither merged call: each request of a merged command runs as itself."""

    train_mode = "lora"

    def __init__(self) -> None:
        self.calls: list[object] = []

    def forward_backward(self, key, data, loss_fn, loss_config, forward_only=False) -> ForwardBackwardOutput:
        self.calls.append(key)
        if key == "bad":
            raise UserError("a bad batch")
        return ForwardBackwardOutput(logprobs=[], elementwise_loss=[], metrics={"loss:sum": 1.0})

    def optim_step(self, key: str, adam: AdamParams) -> dict[str, float]:
        self.calls.append(key)
        return {"step:max": 1.0}


class Merging(OneAtATime, MergesForwardBackward, MergesOptimSteps):
    """A backend declaring both merged calls: a merged command is one call."""

    def forward_backward_many(self, requests) -> list[ForwardBackwardOutput | UserError]:
        self.calls.append(tuple(r.key for r in requests))
        return [ForwardBackwardOutput(logprobs=[], elementwise_loss=[], metrics={}) for _ in requests]

    def optim_step_many(self, requests) -> list[dict[str, float] | UserError]:
        self.calls.append(tuple(r.key for r in requests))
        return [{"step:max": 2.0} for _ in requests]


def test_merged_commands_use_the_backends_merged_calls_only_where_it_declares_them() -> None:
    forwards = ForwardBackwardMany(tuple(ForwardBackward(k, [], "cross_entropy", {}) for k in ("a", "bad")))
    steps = OptimStepMany((OptimStep("a", AdamParams()), OptimStep("b", AdamParams())))
    alone = OneAtATime()
    outcomes = forwards.run(alone)
    assert isinstance(outcomes[0], ForwardBackwardOutput) and isinstance(outcomes[1], UserError)
    assert steps.run(alone) == [{"step:max": 1.0}, {"step:max": 1.0}]
    assert alone.calls == ["a", "bad", "a", "b"]
    merging = Merging()
    assert len(forwards.run(merging)) == 2 and steps.run(merging) == [{"step:max": 2.0}] * 2
    assert merging.calls == [("a", "bad"), ("a", "b")]
