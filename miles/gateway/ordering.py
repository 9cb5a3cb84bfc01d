"""Per-model execution strictly in `seq_id` order.

The SDK pipelines: optim_step is submitted before the forward_backward result is read, and the chunks of
one call are submitted concurrently, first chunk last. So a model's operations are buffered until every
lower seq_id has run. A gap that is not filled within `gap_timeout_s` fails the waiting operations with a
message naming the missing seq_id, and the queue moves past them. A seq_id whose request the gateway
refused before queueing (an unknown route, a 4xx) is `skip`ped, so the next one runs at once instead of
waiting out the gap: the SDK does not resend a refused request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Job = Callable[[], Awaitable[None]]
Reject = Callable[[str], Awaitable[None]]


@dataclass
class _Entry:
    job: Job
    reject: Reject
    queued_at: float = field(default_factory=time.monotonic)


class SeqQueue:
    """Runs the jobs of one model one at a time, in ascending seq_id, starting at `first_seq`."""

    def __init__(self, name: str, *, first_seq: int, gap_timeout_s: float) -> None:
        self.name = name
        self._next = first_seq
        self._gap_timeout_s = gap_timeout_s
        self._buffered: dict[int, _Entry] = {}
        self._skipped: set[int] = set()
        self._wakeup = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._closed = False

    async def submit(self, seq_id: int | None, job: Job, reject: Reject) -> None:
        """Queue `job` at `seq_id` (None: after all queued so far); `reject(msg)` if it never can run."""
        if self._closed:
            await reject(f"model {self.name} is closed")
            return
        if seq_id is None:
            seq_id = max([self._next - 1, *self._buffered]) + 1
        if seq_id < self._next or seq_id in self._buffered:
            await reject(
                f"seq_id {seq_id} for model {self.name} is out of order: operations up to "
                f"{self._next - 1} were already taken; the next expected seq_id is {self._next}"
            )
            return
        self._skipped.discard(seq_id)  # a real operation at a refused seq_id: it runs after all
        self._buffered[seq_id] = _Entry(job, reject)
        self._wake()

    @property
    def waiting(self) -> int:
        """Operations queued and not started (the one running is not counted)."""
        return len(self._buffered)

    def skip(self, seq_id: int) -> bool:
        """Account for `seq_id` as refused before queueing: nothing runs there and later ones do not wait
        on it. False (and nothing changes) when that seq_id is already taken or queued."""
        if self._closed or seq_id < self._next or seq_id in self._buffered:
            return False
        self._skipped.add(seq_id)
        self._wake()
        return True

    def _wake(self) -> None:
        self._wakeup.set()
        if self._buffered and (self._runner is None or self._runner.done()):
            self._runner = asyncio.create_task(self._run(), name=f"seq-queue-{self.name}")

    async def _run(self) -> None:
        while self._buffered and not self._closed:
            while self._next in self._skipped:
                self._skipped.discard(self._next)
                self._next += 1
            entry = self._buffered.pop(self._next, None)
            if entry is not None:
                self._next += 1
                await entry.job()
                continue
            self._wakeup.clear()
            oldest = min(e.queued_at for e in self._buffered.values())
            remaining = oldest + self._gap_timeout_s - time.monotonic()
            if remaining <= 0:
                await self._fail_gap()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    async def _fail_gap(self) -> None:
        waiting = sorted(self._buffered.items())
        self._buffered.clear()
        missing = self._next
        self._next = waiting[-1][0] + 1
        self._skipped = {s for s in self._skipped if s >= self._next}
        for seq_id, entry in waiting:
            await entry.reject(
                f"seq_id {seq_id} for model {self.name} waited {self._gap_timeout_s:.0f} s for seq_id "
                f"{missing}, which never arrived; resubmit from seq_id {self._next}"
            )

    async def close(self, reason: str, *, cancel_running: bool = True) -> None:
        """Refuse new and queued jobs with `reason`; cancel the running job, or let it finish first."""
        self._closed = True
        waiting = list(self._buffered.values())
        self._buffered.clear()
        self._wakeup.set()  # a runner waiting out a gap re-checks and stops
        for entry in waiting:
            await entry.reject(reason)
        if self._runner is not None:
            if cancel_running:
                self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
