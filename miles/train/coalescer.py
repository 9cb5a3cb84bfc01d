"""Several LoRA tenants' forward_backward requests merged into one trainer command, on the caller's side.

The gateway keeps one strict seq_id queue per model and calls the runtime for different models at once.
The runtime hands each forward_backward to a ForwardBackwardCoalescer, which waits up to `window_s` for
other models' requests (no wait once every loaded model has one waiting), then sends them as ONE
`ForwardBackwardMany` command: the backend runs them as one pass over the shared base
(miles/train/backends/multi_tenant.py) and answers one outcome per request. So the merge is decided once,
here, before the command reaches the ranks, and every data-parallel rank runs the same merged batch.

Per model, nothing changes: at most one request per model is in a merged command and the next one of the
same model waits for the following command (its order is kept); a request whose outcome is an error fails
alone. `window_s` 0 sends every request as its own ForwardBackward, as before. A request alone in its window
also goes as a plain ForwardBackward.

States of a request here: PENDING (in `_pending`, cancellable: it is dropped) -> SENT (in a command; a
cancelled caller no longer waits, the command still runs, as any trainer command) -> DONE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles.errors import UserError
from miles.train.backends.base import TrainBackend
from miles.train.commands import ForwardBackward, TrainerCommand
from miles.types import ForwardBackwardOutput

# The default window (runtime.lora_batch_window_ms): off, because on one H200 the batched pass ran at 1.45x
# the same tenants one after another, under the 1.5x set for turning it on (bench/multi_tenant.py,
# docs/gpu.md); a job opts in with a window > 0 (5 ms measured).
DEFAULT_WINDOW_S = 0.0
MAX_MERGED_REQUESTS = 8

Outcome = ForwardBackwardOutput | UserError


@dataclass(frozen=True)
class ForwardBackwardMany(TrainerCommand[list[Outcome]]):
    """Several models' forward_backward requests (one per model) in one pass; one outcome per request:
    its output, or the UserError that failed it alone."""

    requests: tuple[ForwardBackward, ...]

    def run(self, backend: TrainBackend) -> list[Outcome]:
        started = time.perf_counter_ns()
        many = getattr(backend, "forward_backward_many", None)
        if many is not None:
            outcomes = many(self.requests)
        else:  # a backend without the shared pass
            outcomes = [_run_alone(request, backend) for request in self.requests]
        for outcome in outcomes:
            if isinstance(outcome, ForwardBackwardOutput):
                # each request waited for the whole command (the gateway's stage timings)
                outcome.compute_ns = time.perf_counter_ns() - started
        return outcomes


def _run_alone(request: ForwardBackward, backend: TrainBackend) -> Outcome:
    try:
        return request.run(backend)
    except UserError as exc:
        return exc


@dataclass
class CoalescerStats:
    """What the coalescer sent: requests, trainer commands, and the most requests one command merged."""

    requests: int = 0
    commands: int = 0
    largest: int = 0


@dataclass(eq=False)  # identity: a request holds numpy arrays
class _Waiting:
    request: ForwardBackward
    future: asyncio.Future[ForwardBackwardOutput]


RunCommand = Callable[[TrainerCommand[Any]], Awaitable[Any]]


class ForwardBackwardCoalescer:
    def __init__(
        self,
        run: RunCommand,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        models: Callable[[], int] | None = None,
        max_requests: int = MAX_MERGED_REQUESTS,
    ) -> None:
        """`run` sends a command to the trainer (the runtime's own, with its lock); `models` counts the
        models that could have a request waiting (waiting stops early once each has one)."""
        if window_s < 0:
            raise ValueError(f"the batching window must be >= 0 seconds (0: off), got {window_s}")
        self._run = run
        self.window_s = window_s
        self._models = models
        self._max_requests = max_requests
        self._pending: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None
        self.stats = CoalescerStats()

    async def submit(self, request: ForwardBackward) -> ForwardBackwardOutput:
        if self.window_s <= 0:
            self._count(1)
            return await self._run(request)
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self._pending.append(waiting)
        self._arrived.set()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="forward-backward-coalescer")
        return await waiting.future  # a cancelled caller cancels its future: _take skips it

    async def _drain(self) -> None:
        try:
            while self._pending:
                await self._wait_for_companions()
                batch = self._take()
                if batch:
                    await self._send(batch)
        except asyncio.CancelledError:
            for waiting in self._pending:
                waiting.future.cancel()
            raise

    async def _wait_for_companions(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while not self._everyone_waiting():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _everyone_waiting(self) -> bool:
        if self._models is None:
            return False
        keys = {w.request.key for w in self._pending if not w.future.done()}
        return len(keys) >= min(self._models(), self._max_requests)

    def _take(self) -> list[_Waiting]:
        """The oldest waiting request of each model, all with the first one's forward_only flag."""
        self._pending = [w for w in self._pending if not w.future.done()]
        batch: list[_Waiting] = []
        keys: set[str] = set()
        for waiting in self._pending:
            request = waiting.request
            if len(batch) == self._max_requests:
                break
            if request.key in keys or (batch and request.forward_only != batch[0].request.forward_only):
                continue
            batch.append(waiting)
            keys.add(request.key)
        self._pending = [w for w in self._pending if w not in batch]
        return batch

    async def _send(self, batch: list[_Waiting]) -> None:
        command: TrainerCommand[Any] = (
            batch[0].request if len(batch) == 1 else ForwardBackwardMany(tuple(w.request for w in batch))
        )
        self._count(len(batch))
        try:
            result = await self._run(command)
            outcomes = [result] if len(batch) == 1 else list(result)
            if len(outcomes) != len(batch):
                raise RuntimeError(f"{command.name} answered {len(outcomes)} outcomes for {len(batch)}")
        except asyncio.CancelledError:  # the loop is closing: nobody will settle these any more
            for waiting in batch:
                waiting.future.cancel()
            raise
        except Exception as exc:  # the command failed as a whole (a dead trainer): every request with it
            for waiting in batch:
                _settle(waiting.future, exc)
            return
        for waiting, outcome in zip(batch, outcomes, strict=True):
            _settle(waiting.future, outcome)

    def _count(self, requests: int) -> None:
        self.stats.requests += requests
        self.stats.commands += 1
        self.stats.largest = max(self.stats.largest, requests)


def _settle(future: asyncio.Future[ForwardBackwardOutput], outcome: Outcome | BaseException) -> None:
    if future.done():  # its caller gave up (cancelled) while the command ran
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
