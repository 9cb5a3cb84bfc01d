"""The common shape of a scheduler: submit a script, ask a job's state, cancel it.

Every call to a scheduler tool goes through `run_tool`: an argv list (never a shell), a timeout, and an
error that keeps the tool's own message (stdout and stderr: qsub prints its errors on stdout).
"""

from __future__ import annotations

import enum
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DEFAULT_TOOL_TIMEOUT_S = 60.0


class State(enum.StrEnum):
    """A job's state, the same words for every scheduler."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({State.COMPLETED, State.FAILED, State.CANCELLED, State.TIMEOUT})


@dataclass(frozen=True)
class JobState:
    """What the scheduler says about a job: our state word, its own word, the exit code when known."""

    state: State
    raw: str
    exit_code: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"state": self.state.value, "raw": self.raw, "exit_code": self.exit_code}


class SchedulerError(RuntimeError):
    """A scheduler tool failed; the message carries the tool's own output."""


class Scheduler(Protocol):
    name: str

    def submit(self, script: Path, run_dir: Path) -> str:
        """Submit the job script; return the scheduler's job id."""
        ...

    def status(self, job_id: str) -> JobState: ...

    def cancel(self, job_id: str) -> None: ...


def run_tool(
    argv: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a scheduler tool and return its result, whatever its exit status.

    Raises SchedulerError only when the tool cannot be run at all (missing, timed out).
    """
    argv = [str(a) for a in argv]
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except FileNotFoundError as exc:
        raise SchedulerError(f"{argv[0]}: command not found (is the scheduler's client on PATH?)") from exc
    except subprocess.TimeoutExpired as exc:
        raise SchedulerError(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from exc


def tool_output(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr together, stripped: where a tool's message may be."""
    return "\n".join(part.strip() for part in (result.stdout, result.stderr) if part and part.strip())


def tool_failed(result: subprocess.CompletedProcess[str]) -> SchedulerError:
    """The error for a tool that exited non-zero, with the tool's own words."""
    command = " ".join(str(a) for a in result.args)
    message = tool_output(result) or "(no output)"
    return SchedulerError(f"{command} failed (exit {result.returncode}): {message}")
