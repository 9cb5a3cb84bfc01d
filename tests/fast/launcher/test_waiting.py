"""The wait's pure logic: steps and outcomes from observations, exit statuses, which log explains a
failure, and the scheduler-poll backoff."""

from __future__ import annotations

import pytest

from launcher.schedulers.base import State
from launcher.waiting import (
    UNKNOWN_LIMIT,
    Backoff,
    Observation,
    Outcome,
    WaitTracker,
    exit_status,
    failing_component,
    step_name,
)
from miles.contract.exit_codes import EXIT_SIGTERM, JobExit


def feed(tracker: WaitTracker, *seen: tuple[float, Observation]) -> list[str]:
    started = []
    for now, observation in seen:
        started += [step.name for step in tracker.observe(observation, now)]
    return started


def test_a_job_coming_up_goes_through_pending_running_each_phase_then_serving() -> None:
    tracker = WaitTracker(started_at=0.0)
    started = feed(
        tracker,
        (0.0, Observation(State.PENDING, None, False)),
        (1.0, Observation(None, None, False)),  # scheduler not asked: still pending
        (4.0, Observation(State.RUNNING, None, False)),
        (5.0, Observation(None, "ray", False)),
        (6.0, Observation(None, "ray", False)),
        (9.0, Observation(None, "model", False)),
        (12.0, Observation(None, "serving", False)),  # the driver serves; healthz has not said 200 yet
    )
    assert tracker.outcome is None
    started += feed(tracker, (13.0, Observation(None, "serving", True)))
    assert started == ["PENDING", "RUNNING", "ray", "model", "serving"]
    assert tracker.outcome is Outcome.SERVING
    assert [(s.name, s.elapsed(13.0)) for s in tracker.steps] == [
        ("PENDING", 4.0),
        ("RUNNING", 1.0),
        ("ray", 4.0),
        ("model", 3.0),
        ("serving", 1.0),
    ]


def test_healthy_without_a_phase_file_is_serving() -> None:
    """The watchdog's healthy file alone (a driver that writes no phases) ends the wait."""
    tracker = WaitTracker(started_at=0.0)
    assert feed(tracker, (0.0, Observation(State.RUNNING, None, True))) == ["serving"]
    assert tracker.outcome is Outcome.SERVING


@pytest.mark.parametrize(
    ("state", "code", "outcome", "status"),
    [
        (State.FAILED, JobExit.STARTUP_FAILED, Outcome.FAILED, JobExit.STARTUP_FAILED),
        (State.FAILED, JobExit.TRAINER_DEAD, Outcome.FAILED, JobExit.TRAINER_DEAD),
        (State.FAILED, 137, Outcome.FAILED, JobExit.FAILED),  # not one of ours: the generic failure
        (State.FAILED, None, Outcome.FAILED, JobExit.FAILED),
        (State.CANCELLED, 143, Outcome.CANCELLED, EXIT_SIGTERM),
        (State.TIMEOUT, 5, Outcome.WALLTIME, JobExit.WALLTIME),
        (State.COMPLETED, 0, Outcome.COMPLETED, JobExit.FAILED),  # ended without ever serving
    ],
)
def test_a_job_that_ends_before_serving_ends_the_wait_with_its_state(
    state: State, code: int | None, outcome: Outcome, status: int
) -> None:
    tracker = WaitTracker(started_at=0.0)
    feed(
        tracker,
        (0.0, Observation(State.RUNNING, "model", False)),
        (3.0, Observation(state, "model", False, code)),
    )
    assert tracker.outcome is outcome and tracker.exit_code == code
    assert tracker.steps[-1].ended_at == 3.0
    assert exit_status(outcome, True, code) == status


def test_an_ended_job_with_a_stale_healthy_file_is_not_serving() -> None:
    tracker = WaitTracker(started_at=0.0)
    feed(tracker, (0.0, Observation(State.FAILED, "stopped", True, 3)))
    assert tracker.outcome is Outcome.FAILED


def test_waiting_for_the_end_succeeds_on_completion_only() -> None:
    tracker = WaitTracker(started_at=0.0, until_serving=False)
    feed(tracker, (0.0, Observation(State.RUNNING, "serving", True)))
    assert tracker.outcome is None  # serving is not the end it waits for
    feed(tracker, (2.0, Observation(State.COMPLETED, "stopped", True, 0)))
    assert tracker.outcome is Outcome.COMPLETED and exit_status(Outcome.COMPLETED, False, 0) == 0


def test_the_wait_times_out_and_says_so() -> None:
    tracker = WaitTracker(started_at=10.0, timeout_s=5.0)
    feed(tracker, (10.0, Observation(State.PENDING, None, False)), (14.9, Observation(None, None, False)))
    assert tracker.outcome is None
    feed(tracker, (15.0, Observation(None, None, False)))
    assert tracker.outcome is Outcome.WAIT_TIMEOUT
    assert exit_status(Outcome.WAIT_TIMEOUT, True, None) == JobExit.STARTUP_TIMEOUT


def test_a_job_the_scheduler_forgot_ends_the_wait_after_some_unknown_answers() -> None:
    tracker = WaitTracker(started_at=0.0)
    feed(tracker, (0.0, Observation(State.RUNNING, "ray", False)))
    for i in range(UNKNOWN_LIMIT - 1):
        feed(tracker, (1.0 + i, Observation(State.UNKNOWN, "ray", False)))
    feed(tracker, (5.0, Observation(None, "ray", False)))  # not asked: the count stands
    feed(tracker, (6.0, Observation(State.RUNNING, "ray", False)))  # known again: the count resets
    assert tracker.outcome is None and tracker.state is State.RUNNING
    for i in range(UNKNOWN_LIMIT):
        feed(tracker, (10.0 + i, Observation(State.UNKNOWN, "ray", False)))
    assert tracker.outcome is Outcome.LOST and exit_status(Outcome.LOST, True, None) == JobExit.FAILED


def test_no_observation_after_the_end() -> None:
    tracker = WaitTracker(started_at=0.0)
    feed(tracker, (0.0, Observation(State.RUNNING, None, True)))
    with pytest.raises(RuntimeError, match="already ended"):
        tracker.observe(Observation(None, None, True), 1.0)


def test_step_name_prefers_health_then_phase_then_the_scheduler() -> None:
    assert step_name(None, None, False) == "PENDING"  # submitted, not asked yet
    assert step_name(State.RUNNING, None, False) == "RUNNING"
    assert step_name(State.RUNNING, "cells", False) == "cells"
    assert step_name(State.RUNNING, "gateway", True) == "serving"


@pytest.mark.parametrize(
    ("code", "driver_started", "available", "expected"),
    [
        (JobExit.STARTUP_FAILED, True, ["driver", "job", "monitor"], "driver"),
        (JobExit.STARTUP_TIMEOUT, True, ["driver", "job", "monitor"], "monitor"),
        (JobExit.FAILED, False, ["job", "ray-head"], "job"),
        (EXIT_SIGTERM, True, ["driver", "job"], "driver"),  # cancelled while the driver ran
        (EXIT_SIGTERM, False, ["driver", "job"], "job"),
        (None, False, ["job"], "job"),
        (JobExit.STARTUP_FAILED, True, ["job"], "job"),  # no driver log: the job's says what happened
        (JobExit.STARTUP_FAILED, True, ["slurm-12"], "slurm-12"),
        (JobExit.FAILED, False, [], None),
    ],
)
def test_failing_component(
    code: int | None, driver_started: bool, available: list[str], expected: str
) -> None:
    assert failing_component(code, driver_started, available) == expected


def test_backoff_starts_near_a_second_and_stops_growing_at_its_cap() -> None:
    backoff = Backoff()
    delays = [backoff.delay(i) for i in range(10)]
    assert delays[:4] == [1.0, 1.5, 2.25, 3.375]
    assert delays == sorted(delays) and delays[-1] == 10.0 and max(delays) == 10.0
    assert Backoff(start_s=2, factor=1, cap_s=5).delay(50) == 2.0
    assert backoff.delay(10**6) == 10.0  # no overflow however long the wait


@pytest.mark.parametrize("bad", [{"start_s": 0}, {"factor": 0.5}, {"start_s": 20, "cap_s": 10}])
def test_backoff_refuses_a_schedule_that_would_not_back_off(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**bad)
