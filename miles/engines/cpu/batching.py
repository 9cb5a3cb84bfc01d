"""The step scheduler: every running sequence advances one token per model step, all of them in one forward
(one per LoRA adapter in use), instead of one forward per request.

Requests are admitted by `Engine.admit` as before, then handed here as rows. One asyncio task loops: drop
aborted rows, park every row while the engine is paused (retract drops the KV, in_place keeps it), then
step: rows that arrived meanwhile are prefilled together and join the running batch, and every running row
decodes one token in the same forward (step.py, on the model thread). Nothing waits for more requests to
come: a lone request steps alone at once, and requests arriving during a step join the next one. At most
`max_running_requests` rows hold a KV cache; the rest wait in arrival order.

Rows of different adapters never share a forward (an adapter is merged into the weights while it runs), so
each adapter has its own batch and cache, stepped one after the other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from miles.engines.cpu.requests import Phase, RequestHandle
from miles.engines.cpu.runner import ModelRunner
from miles.engines.cpu.sequence import ABORTED, GenJob, GenState, check_stop, score_output, score_prompt
from miles.engines.cpu.step import Batch, GroupPlan, RowPlan, RowResult, StepStats, run_group_step

if TYPE_CHECKING:
    from miles.engines.cpu.engine import Engine

log = logging.getLogger(__name__)
# Padded tokens per prefill forward (SGLang's --max-prefill-tokens default): a burst of long prompts is
# prefilled over several steps rather than in one forward of unbounded activation memory.
PREFILL_TOKEN_BUDGET = 16384
PARKED = frozenset({Phase.PAUSED_IN_PLACE, Phase.RETRACTED})
Update = tuple[int, bool] | BaseException  # (tokens so far, finished) or the error that ended the row


@dataclass(eq=False)
class Row:
    job: GenJob
    handle: RequestHandle
    state: GenState
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    pending: int | None = None  # the newest sampled token, not in the KV cache yet (the next step feeds it)
    done: bool = False  # finished or failed: it takes no more steps
    closed: bool = False  # its reader left (finished, or the client went away)

    @property
    def live(self) -> bool:
        return not (self.done or self.closed)

    def sequence(self) -> list[int]:
        """What a prefill must feed: the prompt and everything generated (after a retraction too)."""
        return self.job.prompt_ids + self.state.output_ids


@dataclass(eq=False)
class Group:
    """The rows of one adapter: `rows` are the rows of `kv`, in order (finished ones until the next step
    drops them); `joining` are admitted rows to prefill at the next step."""

    adapter: str | None
    kv: Batch | None = None
    rows: list[Row] = field(default_factory=list)
    joining: list[Row] = field(default_factory=list)

    def live(self) -> list[Row]:
        return [row for row in self.rows if row.live]


class StepScheduler:
    def __init__(self, engine: Engine, max_running_requests: int) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be at least 1, got {max_running_requests}")
        self.engine = engine
        self.max_running_requests = max_running_requests
        self.stats = StepStats()
        self._waiting: deque[Row] = deque()
        self._groups: dict[str | None, Group] = {}
        self._task: asyncio.Task[None] | None = None
        self._shared: torch.Generator | None = None

    # ----- the request side --------------------------------------------------------------------------

    async def generate(self, job: GenJob, handle: RequestHandle, state: GenState) -> AsyncIterator[GenState]:
        """Run an admitted request; yields its state after each token, the last time finished."""
        row = Row(job, handle, state)
        self._waiting.append(row)
        self._start()
        await self.engine._notify()
        try:
            while True:
                update = await row.updates.get()
                if isinstance(update, BaseException):
                    raise update
                count, finished = update
                current = count == len(state.output_ids) and finished == (state.finish_reason is not None)
                yield state if current else state.upto(count)
                if finished:
                    return
        finally:
            row.closed = True

    def snapshot(self) -> dict[str, Any]:
        """Counters for /server_info's internal_states."""
        return {
            "max_running_requests": self.max_running_requests,
            "num_running_reqs": sum(len(g.live()) for g in self._groups.values()),
            "num_queued_reqs": len(self._waiting),
            "forward_steps": self.stats.forwards,
            "decode_steps": self.stats.decode_steps,
            "last_batch_size": self.stats.last_batch_size,
            "max_batch_size": self.stats.max_batch_size,
        }

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ----- the loop ----------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="cpu-engine-steps")

    async def _run(self) -> None:
        try:
            while True:
                await self.engine._wait(self._has_work)
                await self._iterate()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must fail the requests, not leave them waiting forever
            log.exception("the step scheduler failed; failing its requests")
            self._fail_everything(exc)

    def _rows(self) -> list[Row]:
        rows = [row for group in self._groups.values() for row in (*group.live(), *group.joining)]
        return rows + list(self._waiting)

    def _has_work(self) -> bool:
        rows = self._rows()
        if any(row.closed or row.handle.aborted for row in rows):
            return True
        if self.engine.pause_mode is not None:
            return any(row.handle.phase is Phase.RUNNING for row in rows)
        if any(row.handle.phase in PARKED for row in rows):
            return self.engine._may_run()
        return bool(rows)

    async def _iterate(self) -> None:
        self._reap()
        if self.engine.pause_mode is not None:
            if self._park():
                await self.engine._notify()  # pause_generation returns once nothing is RUNNING
            return
        parked = [row for row in self._rows() if row.handle.phase in PARKED]
        if parked:
            if not self.engine._may_run():
                return
            for row in parked:
                row.handle.move(Phase.RUNNING)
        await self._step()

    # ----- aborts and pauses -------------------------------------------------------------------------

    def _reap(self) -> None:
        """Finish aborted rows (their reader answers at once) and forget rows whose reader left."""
        for row in list(self._waiting):
            if row.closed or row.handle.aborted:
                self._waiting.remove(row)
                if not row.closed:
                    self._finish(row, ABORTED)
        for group in self._groups.values():
            for row in group.live():
                if row.handle.aborted:
                    self._finish(row, ABORTED)
            self._release_if_idle(group)

    def _park(self) -> bool:
        """Park every running row; True when any moved. Retract drops the KV caches: those rows are
        prefilled again (prompt + output so far) when generation continues."""
        retract = self.engine.pause_mode == "retract"
        parked_phase = Phase.RETRACTED if retract else Phase.PAUSED_IN_PLACE
        moved = False
        for group in self._groups.values():
            holding = group.live()
            for row in holding:
                if row.handle.phase is Phase.RUNNING and self.engine.must_park(row.handle):
                    row.handle.move(parked_phase)
                    if retract:
                        row.handle.num_retractions += 1
                    moved = True
            if retract and holding:
                for row in holding:
                    row.pending = None
                self._waiting.extendleft(reversed(holding))  # first in line, in their batch order
                group.kv, group.rows = None, []
        for row in self._waiting:  # admitted but holding no KV yet: nothing to retract
            if row.handle.phase is Phase.RUNNING and self.engine.must_park(row.handle):
                row.handle.move(parked_phase)
                moved = True
        return moved

    # ----- stepping ----------------------------------------------------------------------------------

    async def _step(self) -> None:
        runner = self.engine.model()
        self._admit(runner)
        # the adapter merged into the weights now goes first: one adapter switch fewer per step
        for group in sorted(self._groups.values(), key=lambda g: g.adapter != runner.active_adapter):
            if group.live() or group.joining:
                await self._step_group(runner, group)
        self._groups = {a: g for a, g in self._groups.items() if g.rows or g.joining}

    def _admit(self, runner: ModelRunner) -> None:
        """Move waiting rows (arrival order) into their groups, up to the row cap and the prefill budget."""
        cap = self.max_running_requests if runner.batchable else 1
        running = sum(len(g.live()) + len(g.joining) for g in self._groups.values())
        joined, widest = 0, 0
        while self._waiting and running < cap:
            row = self._waiting[0]
            wider = max(widest, len(row.sequence()))
            if joined and (joined + 1) * wider > PREFILL_TOKEN_BUDGET:
                break
            self._waiting.popleft()
            self._groups.setdefault(row.job.adapter, Group(row.job.adapter)).joining.append(row)
            running, joined, widest = running + 1, joined + 1, wider

    async def _step_group(self, runner: ModelRunner, group: Group) -> None:
        plan, order = self._plan(group)
        step = functools.partial(run_group_step, runner, plan, self._shared_generator(runner), self.stats)
        try:
            kv, results = await self.engine.on_model_thread(step)
        except Exception as exc:  # the forward failed (e.g. out of memory): these rows fail, others go on
            log.exception("a model step of %d rows failed", len(order))
            self._fail(order, exc)
            group.kv, group.rows = None, []
            return
        group.kv, group.rows = kv, order
        self._apply(runner, order, results)
        self._release_if_idle(group)

    def _plan(self, group: Group) -> tuple[GroupPlan, list[Row]]:
        keep = [i for i, row in enumerate(group.rows) if row.live]
        kept = [group.rows[i] for i in keep]
        # rows that need every prompt position's logits prefill in a forward of their own, after the others
        joining = sorted(group.joining, key=_needs_prompt_logits)
        group.joining = []
        decode = [
            RowPlan(r.job.cfg, _own_generator(r), r.job.scores_output, [r.pending])  # type: ignore[list-item]
            for r in kept
        ]
        prefill = [
            RowPlan(r.job.cfg, _own_generator(r), r.job.scores_output, r.sequence(), _needs_prompt_logits(r))
            for r in joining
        ]
        horizon = max((r.job.cfg.max_new_tokens - len(r.state.output_ids) for r in kept + joining), default=1)
        return GroupPlan(group.adapter, group.kv, keep, decode, prefill, horizon), kept + joining

    def _apply(self, runner: ModelRunner, rows: list[Row], results: list[RowResult]) -> None:
        """Each row's new token into its state (scores, stop conditions), then a word to its reader."""
        for row, result in zip(rows, results, strict=True):
            if row.closed:
                continue
            if row.handle.aborted:  # aborted during the step: the token is not reported
                self._finish(row, ABORTED)
                continue
            job, state = row.job, row.state
            if result.prompt_logits is not None and not state.input_scored:
                score_prompt(job, state, result.prompt_logits)
            state.output_ids.append(result.token)
            state.output_logprobs.append(result.logprob)
            if job.return_logprob:
                score_output(job, state, result.logits)
            decode = functools.partial(_decode, runner, job)
            check_stop(job, state, result.token, runner.eos_token_ids, decode)
            row.pending = result.token
            row.done = state.finish_reason is not None
            row.updates.put_nowait((len(state.output_ids), row.done))

    # ----- endings -----------------------------------------------------------------------------------

    def _finish(self, row: Row, reason: dict[str, Any]) -> None:
        row.state.finish_reason = dict(reason)
        row.done = True
        row.updates.put_nowait((len(row.state.output_ids), True))

    def _fail(self, rows: list[Row], exc: BaseException) -> None:
        for row in rows:
            if row.live:
                row.done = True
                row.updates.put_nowait(exc)

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail(self._rows(), exc)
        self._waiting.clear()
        self._groups.clear()

    def _release_if_idle(self, group: Group) -> None:
        """A batch whose rows all ended frees its cache now, not at the next step (there may be none)."""
        if group.rows and not group.live():
            group.kv, group.rows = None, []

    def _shared_generator(self, runner: ModelRunner) -> torch.Generator:
        """The generator of unseeded rows, on the model's device (their draws need no CPU copy)."""
        if self._shared is None:
            self._shared = torch.Generator(device=runner.device)
            self._shared.seed()
        return self._shared


def _needs_prompt_logits(row: Row) -> bool:
    return row.job.scores_prompt and not row.state.input_scored


def _own_generator(row: Row) -> torch.Generator | None:
    """A seeded request's generator (its draws then do not depend on its batch); None for unseeded rows."""
    return row.job.gen if row.job.cfg.seed is not None else None


def _decode(runner: ModelRunner, job: GenJob, ids: list[int]) -> str:
    return runner.tokenizer.decode(ids, skip_special_tokens=job.cfg.skip_special_tokens)
