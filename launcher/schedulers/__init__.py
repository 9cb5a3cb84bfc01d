"""Scheduler back-ends: one module each (pbs, slurm, local) behind the protocol in `base`."""

from __future__ import annotations

from pathlib import Path

from launcher.schedulers.base import FINISHED_STATES, JobState, Scheduler, SchedulerError, State
from launcher.schedulers.local import LocalScheduler
from launcher.schedulers.pbs import PbsScheduler
from launcher.schedulers.slurm import SlurmScheduler

SCHEDULER_NAMES = ("local", "pbs", "slurm")


def get_scheduler(name: str, run_dir: Path | None = None) -> Scheduler:
    """The scheduler called `name`; the local one needs the run directory to find its job."""
    if name == "local":
        return LocalScheduler(run_dir=run_dir)
    if name == "slurm":
        return SlurmScheduler()
    if name == "pbs":
        return PbsScheduler()
    raise SchedulerError(f"unknown scheduler {name!r}: choose one of {', '.join(SCHEDULER_NAMES)}")


__all__ = [
    "FINISHED_STATES",
    "SCHEDULER_NAMES",
    "JobState",
    "LocalScheduler",
    "PbsScheduler",
    "Scheduler",
    "SchedulerError",
    "SlurmScheduler",
    "State",
    "get_scheduler",
]
