"""Pure logic of waiting for a job to come up: the steps it goes through, when the wait ends, how often
to ask the scheduler, and which log explains a failure. No I/O here; `launcher.api.Job.wait` feeds it.

A job goes PENDING -> RUNNING (the job script: nodes, Ray) -> the driver's phases as it writes them to
RUN_DIR/phase (ray, model, placement, cells, weights, gateway, serving) -> serving (healthz answered 200).
The wait ends SERVING, or with the scheduler's end state if the job ends first, or WAIT_TIMEOUT.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from launcher.schedulers.base import State
from miles.contract.exit_codes import EXIT_SIGTERM, JobExit

PENDING_STEP = "PENDING"
RUNNING_STEP = "RUNNING"
SERVING_STEP = "serving"
# the scheduler forgets a job it once knew (Slurm's MinJobAge, a purged PBS history): after this many
# UNKNOWN answers in a row the wait stops instead of polling forever
UNKNOWN_LIMIT = 3


class Outcome(enum.StrEnum):
    SERVING = "serving"
    COMPLETED = "completed"  # the job ended with status 0 (before serving, when waiting for serving)
    FAILED = "failed"
    CANCELLED = "cancelled"
    WALLTIME = "walltime"  # the scheduler's time limit ended the job
    LOST = "lost"  # the scheduler no longer knows the job
    WAIT_TIMEOUT = "wait-timeout"  # our own --timeout; the job itself goes on


ENDED_BY_STATE = {
    State.COMPLETED: Outcome.COMPLETED,
    State.FAILED: Outcome.FAILED,
    State.CANCELLED: Outcome.CANCELLED,
    State.TIMEOUT: Outcome.WALLTIME,
}


@dataclass(frozen=True)
class Observation:
    """One look at the job. `state` is None on ticks where the scheduler was not asked."""

    state: State | None
    phase: str | None  # what the driver last wrote to RUN_DIR/phase
    healthy: bool  # the watchdog wrote RUN_DIR/healthy, or healthz answered 200 once the driver serves
    exit_code: int | None = None


@dataclass
class Step:
    name: str
    started_at: float
    ended_at: float | None = None

    def elapsed(self, now: float) -> float:
        return (self.ended_at if self.ended_at is not None else now) - self.started_at


def step_name(state: State | None, phase: str | None, healthy: bool) -> str:
    """The step a job is in, from the last scheduler state and the driver's phase file."""
    if healthy:
        return SERVING_STEP
    if phase:
        return phase
    if state is State.RUNNING:
        return RUNNING_STEP
    return PENDING_STEP


@dataclass
class WaitTracker:
    """State machine of one wait: feed it observations; it records the steps and decides the outcome."""

    started_at: float
    until_serving: bool = True
    timeout_s: float | None = None
    steps: list[Step] = field(default_factory=list)
    outcome: Outcome | None = None
    state: State | None = None
    exit_code: int | None = None
    unknown_in_a_row: int = 0

    @property
    def current(self) -> Step | None:
        return self.steps[-1] if self.steps else None

    def observe(self, seen: Observation, now: float) -> list[Step]:
        """Take one observation; return the steps it started (the transitions to show)."""
        if self.outcome is not None:
            raise RuntimeError(f"the wait already ended: {self.outcome}")
        if seen.state is not None:
            self._take_state(seen.state, seen.exit_code)
        started = self._advance(step_name(self.state, seen.phase, seen.healthy), now)
        if seen.healthy and self.until_serving and self.state not in (State.UNKNOWN, *ENDED_BY_STATE):
            self._end(Outcome.SERVING, now)
        elif self.state in ENDED_BY_STATE:
            self._end(ENDED_BY_STATE[self.state], now)
        elif self.unknown_in_a_row >= UNKNOWN_LIMIT:
            self._end(Outcome.LOST, now)
        elif self.timeout_s is not None and now - self.started_at >= self.timeout_s:
            self._end(Outcome.WAIT_TIMEOUT, now)
        return started

    def _take_state(self, state: State, exit_code: int | None) -> None:
        self.unknown_in_a_row = self.unknown_in_a_row + 1 if state is State.UNKNOWN else 0
        if state is not State.UNKNOWN:
            self.state = state
            self.exit_code = exit_code

    def _advance(self, name: str, now: float) -> list[Step]:
        if self.current is not None and self.current.name == name:
            return []
        if self.current is not None:
            self.current.ended_at = now
        step = Step(name, now)
        self.steps.append(step)
        return [step]

    def _end(self, outcome: Outcome, now: float) -> None:
        self.outcome = outcome
        if self.current is not None and outcome is not Outcome.SERVING:
            self.current.ended_at = now


def succeeded(outcome: Outcome, until_serving: bool) -> bool:
    return outcome is Outcome.SERVING or (outcome is Outcome.COMPLETED and not until_serving)


def exit_status(outcome: Outcome, until_serving: bool, job_exit_code: int | None) -> int:
    """The wait command's exit status, in the job's own exit-code words (miles/contract/exit_codes.py)."""
    if succeeded(outcome, until_serving):
        return JobExit.OK
    if outcome is Outcome.FAILED and job_exit_code in {int(c) for c in JobExit} - {0}:
        return int(job_exit_code)
    return {
        Outcome.CANCELLED: EXIT_SIGTERM,
        Outcome.WALLTIME: JobExit.WALLTIME,
        Outcome.WAIT_TIMEOUT: JobExit.STARTUP_TIMEOUT,
    }.get(outcome, JobExit.FAILED)


# Which log says why: the driver's for a bring-up failure or a dead trainer, the watchdog's when the
# gateway never became healthy, the job script's for everything before the driver (nodes, Ray, signals).
LOG_FOR_EXIT: dict[int, str] = {
    JobExit.STARTUP_FAILED: "driver",
    JobExit.TRAINER_DEAD: "driver",
    JobExit.SELFTEST_FAILED: "driver",
    JobExit.STARTUP_TIMEOUT: "monitor",
    JobExit.FAILED: "job",
}


def failing_component(exit_code: int | None, driver_started: bool, available: list[str]) -> str | None:
    """The component whose log explains why the job did not come up; None when there is no log at all."""
    wanted = LOG_FOR_EXIT.get(exit_code) if exit_code is not None else None
    if wanted is None:
        wanted = "driver" if driver_started else "job"
    for name in (wanted, "job"):
        if name in available:
            return name
    return available[0] if available else None


@dataclass(frozen=True)
class Backoff:
    """Delays between scheduler polls: `start_s`, growing by `factor`, never above `cap_s`."""

    start_s: float = 1.0
    factor: float = 1.5
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.start_s <= 0 or self.factor < 1 or self.cap_s < self.start_s:
            raise ValueError(f"backoff needs 0 < start <= cap and factor >= 1, not {self}")

    def delay(self, attempt: int) -> float:
        """The delay after the `attempt`-th poll since the last reset (0 = the first)."""
        return min(self.cap_s, self.start_s * self.factor ** min(attempt, 64))
