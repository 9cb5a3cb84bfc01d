"""Slurm: sbatch / scontrol / squeue / scancel, with pure parsers of their real output.

States come from scontrol (squeue as the fallback), not sacct: sacct needs slurmdbd, which many clusters
lack; docs/operations-slurm.md says why submitit's sacct-based tracking is not used here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.schedulers.base import (
    DEFAULT_TOOL_TIMEOUT_S,
    JobState,
    SchedulerError,
    State,
    run_tool,
    tool_failed,
    tool_output,
)

_STATE_MAP: Mapping[str, State] = {
    "PENDING": State.PENDING,
    "CONFIGURING": State.PENDING,
    "REQUEUED": State.PENDING,
    "REQUEUE_HOLD": State.PENDING,
    "REQUEUE_FED": State.PENDING,
    "RESIZING": State.PENDING,
    "SUSPENDED": State.PENDING,
    "RUNNING": State.RUNNING,
    "COMPLETING": State.RUNNING,
    "STAGE_OUT": State.RUNNING,
    "SIGNALING": State.RUNNING,
    "STOPPED": State.RUNNING,
    "COMPLETED": State.COMPLETED,
    "FAILED": State.FAILED,
    "NODE_FAIL": State.FAILED,
    "OUT_OF_MEMORY": State.FAILED,
    "BOOT_FAIL": State.FAILED,
    "DEADLINE": State.FAILED,
    "PREEMPTED": State.FAILED,
    "SPECIAL_EXIT": State.FAILED,
    "REVOKED": State.FAILED,
    "CANCELLED": State.CANCELLED,
    "TIMEOUT": State.TIMEOUT,
}

_SUBMITTED = re.compile(r"^Submitted batch job (\d+)\b", re.MULTILINE)
_PARSABLE = re.compile(r"^(\d+)(?:;\S+)?$")
_FIELD = re.compile(r"(\w[\w/:]*)=(\S*)")
_INVALID_JOB = "Invalid job id"


def parse_sbatch_output(stdout: str) -> str:
    """The job id from `sbatch --parsable` ("12", "12;cluster") or sbatch ("Submitted batch job 12")."""
    match = _SUBMITTED.search(stdout)
    if match:
        return match.group(1)
    for line in reversed(stdout.strip().splitlines()):
        match = _PARSABLE.match(line.strip())
        if match:
            return match.group(1)
    raise SchedulerError(f"sbatch printed no job id: {stdout.strip() or '(no output)'}")


def slurm_state(word: str) -> State:
    """Our state for a Slurm state word ("CANCELLED by 0" and "RUNNING+" included)."""
    base = word.strip().split(" ")[0].rstrip("+").upper()
    return _STATE_MAP.get(base, State.UNKNOWN)


def parse_exit_code(value: str) -> int | None:
    """Slurm's `rc:signal` as one number: the rc, or 128+signal when a signal ended the job."""
    match = re.fullmatch(r"(\d+):(\d+)", value.strip())
    if not match:
        return None
    rc, sig = int(match.group(1)), int(match.group(2))
    return 128 + sig if sig else rc


def parse_scontrol_job(text: str) -> dict[str, str]:
    """The Key=Value fields of `scontrol show job` (one-line `-o` or the multi-line form)."""
    return {key: value for key, value in _FIELD.findall(text)}


def job_state_from_scontrol(text: str) -> JobState:
    fields = parse_scontrol_job(text)
    raw = fields.get("JobState")
    if raw is None:
        raise SchedulerError(f"scontrol printed no JobState: {text.strip() or '(no output)'}")
    state = slurm_state(raw)
    exit_code = parse_exit_code(fields.get("ExitCode", "")) if state.finished else None
    return JobState(state=state, raw=raw, exit_code=exit_code)


def parse_squeue_state(stdout: str, job_id: str) -> JobState | None:
    """The state from `squeue -h -j ID -o '%i|%T'`; None when squeue no longer lists the job."""
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0] == job_id:
            return JobState(state=slurm_state(parts[1]), raw=parts[1])
    return None


class SlurmScheduler:
    name = "slurm"

    def __init__(self, extra_sbatch_args: Sequence[str] = (), timeout_s: float = DEFAULT_TOOL_TIMEOUT_S):
        self.extra_sbatch_args = list(extra_sbatch_args)
        self.timeout_s = timeout_s

    def submit(self, script: Path, run_dir: Path) -> str:
        argv = ["sbatch", "--parsable", f"--chdir={run_dir}", *self.extra_sbatch_args, str(script)]
        result = run_tool(argv, timeout_s=self.timeout_s, cwd=run_dir)
        if result.returncode != 0:
            raise tool_failed(result)
        return parse_sbatch_output(result.stdout)

    def status(self, job_id: str) -> JobState:
        result = run_tool(["scontrol", "-o", "show", "job", job_id], timeout_s=self.timeout_s)
        if result.returncode == 0:
            return job_state_from_scontrol(result.stdout)
        if _INVALID_JOB in tool_output(result):
            # finished more than MinJobAge ago (1 h by default): Slurm has forgotten it
            return JobState(state=State.UNKNOWN, raw=tool_output(result))
        return self._status_from_squeue(job_id, scontrol_error=tool_output(result))

    def _status_from_squeue(self, job_id: str, scontrol_error: str) -> JobState:
        result = run_tool(["squeue", "-h", "-j", job_id, "-o", "%i|%T"], timeout_s=self.timeout_s)
        if result.returncode != 0:
            raise SchedulerError(f"scontrol and squeue failed for job {job_id}: {scontrol_error}")
        state = parse_squeue_state(result.stdout, job_id)
        return state or JobState(state=State.UNKNOWN, raw=scontrol_error)

    def cancel(self, job_id: str) -> None:
        # without -v, scancel exits 0 even for an unknown job; -v makes it say so on stderr
        result = run_tool(["scancel", "-v", job_id], timeout_s=self.timeout_s)
        error = cancel_error(result.returncode, tool_output(result))
        if error:
            raise SchedulerError(f"scancel {job_id}: {error}")


def cancel_error(returncode: int, output: str) -> str | None:
    """The error in `scancel -v` output, if any (it may exit 0 and still report one)."""
    errors = [line.strip() for line in output.splitlines() if "error" in line.lower()]
    if errors:
        return "; ".join(errors)
    if returncode != 0:
        return output or f"exit {returncode}"
    return None
