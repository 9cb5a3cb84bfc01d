"""Several LoRA tenants' forward_backward requests merged into one trainer command, on the caller's side.

The gateway keeps one strict seq_id queue per model and calls the runtime for different models at once.
The runtime hands each forward_backward to a ForwardBackwardCoalescer, which waits up to `window_s` for
other models' requests (no wait once every recently active model has one waiting, see below), then sends
them as ONE
`ForwardBackwardMany` command: the backend runs them as one pass over the shared base
(miles/train/backends/multi_tenant.py) and answers one outcome per request. So the merge is decided once,
here, before the command reaches the ranks, and every data-parallel rank runs the same merged batch.

Per model, nothing changes: at most one request per model is in a merged command and the next one of the
same model waits for the following command (its order is kept); a request whose outcome is an error fails
alone. `window_s` 0 sends every request as its own ForwardBackward, as before. A request alone in its window
also goes as a plain ForwardBackward.

optim_steps go through the same coalescer: several models' steps waiting at once go as ONE `OptimStepMany`
(miles/train/backends/optim_many.py: each model's own AdamW and clipping, exactly its optim_step, but
queued back to back with one wait for the device). A merged command holds one kind of request: all
forward_backward with the same forward_only flag, or all optim_step.

Whom to wait for: the models that sent a request, or got an answer, in the last `active_s` seconds (1 s),
at most the loaded ones. A model that is loaded but idle (a tenant reading its results, sampling, or gone
for the day) is no companion: a tenant training alone next to idle ones pays no window, where waiting for
every loaded model made it wait out the whole window on every call. Tenants training together resubmit
right after their answers, well inside the second, so they still wait for each other, however long their
pass. Requests waiting at the same moment are merged whatever the decision. A released model is
forgotten at once (`forget`).

States of a request here: PENDING (in `_pending`, cancellable: it is dropped) -> SENT (in a command; a
cancelled caller no longer waits, the command still runs, as any trainer command) -> DONE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.contract.preset.preset import DEFAULT_LORA_BATCH_WINDOW_MS
from miles.errors import UserError
from miles.train.backends.base import MergesForwardBackward, MergesOptimSteps, TrainBackend
from miles.train.commands import ForwardBackward, OptimStep, TrainerCommand, with_rank_times
from miles.types import ForwardBackwardOutput

# The default window (runtime.lora_batch_window_ms): 5 ms. On one H200 (bench/multi_tenant.py; the runs are in
# bench/results/gpu-multi-tenant-lora.md: fifth and sixth calls) 4 tenants' batched step ran 1.64x and 1.49x
# the same tenants one after another, 1.54x over both (the bar for turning batching on: 1.5x); the
# seventh call, modes interleaved over 10 rounds, measured a median of 1.84x (1.64-2.14x) and the eighth 1.79x
# (1.73-1.86x, 4 rounds; its sequential row is this code's level under interleaving, not a regression of the
# routes). 5 ms is 2.7-5% of one tenant's training pass (2 x 2048 tokens, Qwen3-0.6B shape); the wait ends as
# soon as every model active in the last DEFAULT_ACTIVE_S has a request waiting. 0 turns batching off.
DEFAULT_WINDOW_S = DEFAULT_LORA_BATCH_WINDOW_MS / 1000
MAX_MERGED_REQUESTS = 8
# A model that sent a request this recently is a companion worth waiting for. One second is several
# training steps of a tenant in a loop (a Qwen3-0.6B step is 0.1-0.3 s on one H200, the tiny model's
# a few ms), and far shorter than the pauses of a tenant that samples or evaluates between steps.
DEFAULT_ACTIVE_S = 1.0
FORGET_S = 3600.0  # a model silent this long leaves the coalescer's memory (models come and go with sessions)

Outcome = ForwardBackwardOutput | UserError
Request = ForwardBackward | OptimStep


@dataclass(frozen=True)
class ForwardBackwardMany(TrainerCommand[list[Outcome]]):
    """Several models' forward_backward requests (one per model) in one pass; one outcome per request:
    its output, or the UserError that failed it alone."""

    requests: tuple[ForwardBackward, ...]

    def run(self, backend: TrainBackend) -> list[Outcome]:
        started = time.perf_counter_ns()
        if isinstance(backend, MergesForwardBackward):
            outcomes = backend.forward_backward_many(self.requests)
        else:  # a backend without the shared pass
            outcomes = [_run_alone(request, backend) for request in self.requests]
        for outcome in outcomes:
            if isinstance(outcome, ForwardBackwardOutput):
                # each request waited for the whole command (the gateway's stage timings)
                outcome.compute_ns = time.perf_counter_ns() - started
        return outcomes

    def combine(self, results: Sequence[Any]) -> list[Outcome]:
        """Rank 0's outcomes, each output carrying every rank's compute time of the command."""
        outcomes = list(results[0])
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, ForwardBackwardOutput):
                outcomes[i] = with_rank_times(outcome, [rank[i] for rank in results])
        return outcomes


@dataclass(frozen=True)
class OptimStepMany(TrainerCommand[list[dict[str, float] | UserError]]):
    """Several models' optim_steps (one per model); one outcome each: its metrics, or the UserError that
    failed it alone."""

    requests: tuple[OptimStep, ...]

    def run(self, backend: TrainBackend) -> list[dict[str, float] | UserError]:
        if isinstance(backend, MergesOptimSteps):
            return backend.optim_step_many(self.requests)
        return [_run_alone(request, backend) for request in self.requests]  # a backend without it


def _run_alone(request: Request, backend: TrainBackend) -> Any:
    try:
        return request.run(backend)
    except UserError as exc:
        return exc


def _same_kind(first: Request, other: Request) -> bool:
    """Whether `other` may go in one merged command with `first`."""
    if isinstance(first, OptimStep) or isinstance(other, OptimStep):
        return isinstance(first, OptimStep) and isinstance(other, OptimStep)
    return other.forward_only == first.forward_only


@dataclass
class CoalescerStats:
    """What the coalescer sent: requests, trainer commands, the most requests one command merged, and the
    seconds spent waiting for companions (summed over commands: what the window cost)."""

    requests: int = 0
    commands: int = 0
    largest: int = 0
    waited_s: float = 0.0


@dataclass(eq=False)  # identity: a request holds numpy arrays
class _Waiting:
    request: Request
    future: asyncio.Future[Any]


RunCommand = Callable[[TrainerCommand[Any]], Awaitable[Any]]


class ForwardBackwardCoalescer:
    def __init__(
        self,
        run: RunCommand,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        models: Callable[[], int] | None = None,
        max_requests: int = MAX_MERGED_REQUESTS,
        active_s: float = DEFAULT_ACTIVE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`run` sends a command to the trainer (the runtime's own, with its lock); `models` counts the
        models that could have a request waiting (waiting stops early once each has one); `active_s`: how
        recent a model's last request must be for it to count as a companion (math.inf: every model
        that ever sent one); `clock` times those requests (tests pass their own)."""
        if window_s < 0:
            raise ValueError(f"the batching window must be >= 0 seconds (0: off), got {window_s}")
        if active_s <= 0:
            raise ValueError(f"active_s must be > 0 seconds (math.inf: no model goes idle), got {active_s}")
        self._run = run
        self.window_s = window_s
        self.active_s = active_s
        self._clock = clock
        self._last_seen: dict[str, float] = {}  # model -> when it last submitted or was answered
        self._models = models
        self._max_requests = max_requests
        self._pending: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None
        self.stats = CoalescerStats()

    async def submit(self, request: Request) -> Any:
        """The request's outcome: a ForwardBackwardOutput for a ForwardBackward, an OptimStep's metrics."""
        if self.window_s <= 0:
            self._count(1)
            return await self._run(request)
        now = self._clock()
        self._last_seen = {k: t for k, t in self._last_seen.items() if now - t <= FORGET_S}
        self._last_seen[request.key] = now
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self._pending.append(waiting)
        self._arrived.set()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="forward-backward-coalescer")
        return await waiting.future  # a cancelled caller cancels its future: _take skips it

    async def _drain(self) -> None:
        try:
            while self._pending:
                began = time.monotonic()
                await self._wait_for_companions()
                self.stats.waited_s += time.monotonic() - began
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
        """Whether every companion has a request waiting: every recently active model, or as many models
        as are loaded, or as many as one command takes."""
        waiting = {w.request.key for w in self._pending if not w.future.done()}
        loaded = self._models() if self._models is not None else None
        if len(waiting) >= self._max_requests or (loaded is not None and len(waiting) >= loaded):
            return True
        return self.active_models() <= waiting

    def forget(self, key: str) -> None:
        """`key`'s model was released: no request waits for it any more (it sends nothing again)."""
        self._last_seen.pop(key, None)
        self._arrived.set()  # the waiting request looks again at whom it waits for

    def active_models(self) -> set[str]:
        """The models that submitted or were answered in the last `active_s` seconds."""
        now = self._clock()
        return {key for key, seen in self._last_seen.items() if now - seen <= self.active_s}

    def _take(self) -> list[_Waiting]:
        """The oldest waiting request of each model, those of the first one's kind (_same_kind). A model
        whose oldest request is of another kind sends nothing now: its later requests wait behind it."""
        self._pending = [w for w in self._pending if not w.future.done()]
        batch: list[_Waiting] = []
        seen: set[str] = set()
        for waiting in self._pending:
            request = waiting.request
            if len(batch) == self._max_requests:
                break
            if request.key in seen:
                continue
            seen.add(request.key)
            if batch and not _same_kind(batch[0].request, request):
                continue
            batch.append(waiting)
        self._pending = [w for w in self._pending if w not in batch]
        return batch

    async def _send(self, batch: list[_Waiting]) -> None:
        command = _command(batch)
        self._count(len(batch))
        try:
            result = await self._run(command)
            self._answered(batch)
            outcomes = [result] if len(batch) == 1 else list(result)
            if len(outcomes) != len(batch):
                raise RuntimeError(f"{command.name} answered {len(outcomes)} outcomes for {len(batch)}")
        except asyncio.CancelledError:  # the loop is closing: nobody will settle these any more
            for waiting in batch:
                waiting.future.cancel()
            raise
        except Exception as exc:  # the command failed as a whole (a dead trainer): every request with it
            self._answered(batch)
            for waiting in batch:
                _settle(waiting.future, exc)
            return
        for waiting, outcome in zip(batch, outcomes, strict=True):
            _settle(waiting.future, outcome)

    def _answered(self, batch: list[_Waiting]) -> None:
        """Its models count as active from now: a model whose request ran longer than `active_s` (a big
        batch) sends its next one right after the answer, and its companions should wait for it."""
        now = self._clock()
        for waiting in batch:
            if waiting.request.key in self._last_seen:  # not forgotten (released) meanwhile
                self._last_seen[waiting.request.key] = now

    def _count(self, requests: int) -> None:
        self.stats.requests += requests
        self.stats.commands += 1
        self.stats.largest = max(self.stats.largest, requests)


def _command(batch: list[_Waiting]) -> TrainerCommand[Any]:
    """One request as itself; several as the merged command of their kind."""
    if len(batch) == 1:
        return batch[0].request
    requests = tuple(w.request for w in batch)
    if isinstance(requests[0], OptimStep):
        return OptimStepMany(requests)  # type: ignore[arg-type]
    return ForwardBackwardMany(requests)  # type: ignore[arg-type]


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():  # its caller gave up (cancelled) while the command ran
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
