"""The job's exit codes: one definition for the driver, the watchdog, the job script and `launcher status`.

The job script gets these numbers rendered in (never typed into the shell), so a scheduler's record of a
job (`Exit_status`, `ExitCode`) means the same thing whichever part of the job ended it.
"""

from __future__ import annotations

import enum


class JobExit(enum.IntEnum):
    OK = 0
    FAILED = 1  # the job script itself failed (nodes, Ray, a missing file): its log says why
    STARTUP_FAILED = 2  # the driver could not bring the service up
    TRAINER_DEAD = 3  # the trainer died: the driver or the watchdog's dead probes ended the job
    STARTUP_TIMEOUT = 4  # the gateway never became healthy within watchdog.startup_timeout_s
    WALLTIME = 5  # the scheduler's advance notice (Slurm --signal) came: shut down in order before the limit
    SELFTEST_FAILED = 6  # `launcher selftest`: a check failed (RUN_DIR/selftest.jsonl says which)


# A job that ends on SIGTERM (qdel, scancel, PBS's walltime kill) or SIGINT exits as the shell would
EXIT_SIGTERM = 128 + 15
EXIT_SIGINT = 128 + 2


def shell_settings() -> dict[str, int]:
    """NAME -> code for the job script (`EXIT_TRAINER_DEAD=3` ...)."""
    codes = {f"EXIT_{code.name}": int(code) for code in JobExit}
    return codes | {"EXIT_SIGTERM": EXIT_SIGTERM, "EXIT_SIGINT": EXIT_SIGINT}
