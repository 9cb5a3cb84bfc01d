"""PBS Professional (and Torque-style wrappers): qsub / qstat / qdel, with pure parsers of their output.

Two things differ between a real PBS Pro and the Torque wrappers of a Slurm cluster (`slurm-wlm-torque`):
- `qstat -x` (finished jobs) exists only on PBS Pro; we try it and fall back to plain `qstat -f`;
- `#PBS -P project` in the script breaks the wrappers' sbatch, so `project_on_command_line` moves the
  directive out of the script and onto qsub's command line, which means the same thing to PBS Pro.
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

_JOB_ID = re.compile(r"^\d+(?:\[\d*\])?(?:\.[\w.-]+)?$")
_PROJECT_DIRECTIVE = re.compile(r"^#PBS\s+-P\s*(\S+)\s*$")
_WALLTIME_KILLED = -29  # PBS Pro JOB_EXEC_KILL_WALLTIME
_SIGNAL_BASE = 256  # PBS Pro reports "killed by signal s" as 256 + s
_SIGTERM = 15

_STATE_MAP: Mapping[str, State] = {
    "Q": State.PENDING,
    "H": State.PENDING,
    "W": State.PENDING,
    "T": State.PENDING,
    "S": State.PENDING,
    "U": State.PENDING,
    "M": State.PENDING,
    "R": State.RUNNING,
    "B": State.RUNNING,
    "E": State.RUNNING,  # exiting: still holding nodes
    "X": State.COMPLETED,  # finished sub-job
}
_FINISHED_LETTERS = frozenset({"F", "C", "X"})


def parse_qsub_output(stdout: str) -> str:
    """The job id qsub printed ("1234.pbs1" on PBS Pro, "1234" from the Torque wrappers)."""
    lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
    if lines and _JOB_ID.match(lines[-1]):
        return lines[-1]
    raise SchedulerError(f"qsub printed no job id: {stdout.strip() or '(no output)'}")


def parse_qstat_full(text: str) -> dict[str, str]:
    """The attributes of `qstat -f` for one job (PBS Pro wraps long values onto tab-indented lines)."""
    attrs: dict[str, str] = {}
    last_key: str | None = None
    for line in text.splitlines():
        if line.startswith("Job Id:"):
            attrs["Job Id"] = line.split(":", 1)[1].strip()
            last_key = None
        elif " = " in line:
            key, value = line.strip().split(" = ", 1)
            attrs[key] = value
            last_key = key
        elif last_key and line.startswith("\t") and line.strip():
            attrs[last_key] += line.strip()
    return attrs


def pbs_state(letter: str, exit_status: int | None) -> State:
    letter = letter.strip().upper()
    if letter in _FINISHED_LETTERS:
        return finished_state(exit_status)
    return _STATE_MAP.get(letter, State.UNKNOWN)


def finished_state(exit_status: int | None) -> State:
    """A finished job's state from its exit status; without one (the Torque wrappers), COMPLETED."""
    if exit_status is None or exit_status == 0:
        return State.COMPLETED
    if exit_status == _WALLTIME_KILLED:
        return State.TIMEOUT
    # qdel: PBS reports 256+15 when the signal killed the script, 128+15 when the script's trap ended it
    if exit_status in (_SIGNAL_BASE + _SIGTERM, 128 + _SIGTERM):
        return State.CANCELLED
    return State.FAILED


def job_state_from_qstat(text: str) -> JobState:
    attrs = parse_qstat_full(text)
    letter = attrs.get("job_state")
    if letter is None:
        raise SchedulerError(f"qstat printed no job_state: {text.strip() or '(no output)'}")
    raw_exit = attrs.get("Exit_status", attrs.get("exit_status"))
    exit_status = int(raw_exit) if raw_exit and re.fullmatch(r"-?\d+", raw_exit) else None
    return JobState(state=pbs_state(letter, exit_status), raw=letter, exit_code=exit_status)


def move_project_to_command_line(script_text: str) -> tuple[str, list[str]]:
    """Drop `#PBS -P x` from the script; return the new text and the qsub arguments that replace it."""
    kept: list[str] = []
    args: list[str] = []
    for line in script_text.splitlines(keepends=True):
        match = _PROJECT_DIRECTIVE.match(line.strip())
        if match:
            args = ["-P", match.group(1)]
        else:
            kept.append(line)
    return "".join(kept), args


class PbsScheduler:
    name = "pbs"

    def __init__(
        self,
        extra_qsub_args: Sequence[str] = (),
        project_on_command_line: bool = False,
        timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
    ):
        self.extra_qsub_args = list(extra_qsub_args)
        self.project_on_command_line = project_on_command_line
        self.timeout_s = timeout_s
        self._has_x = True  # qstat -x (PBS Pro); switched off on the first "Unknown option"

    def submit(self, script: Path, run_dir: Path) -> str:
        args = list(self.extra_qsub_args)
        if self.project_on_command_line:
            text, project_args = move_project_to_command_line(script.read_text())
            script.write_text(text)  # the run dir keeps exactly what was submitted
            args = project_args + args
        # qsub writes its output files (<script>.o<id>) into the working directory
        result = run_tool(["qsub", *args, str(script)], timeout_s=self.timeout_s, cwd=run_dir)
        if result.returncode != 0:
            raise tool_failed(result)
        return parse_qsub_output(result.stdout)

    def status(self, job_id: str) -> JobState:
        result = self._qstat(job_id)
        if result.returncode == 0 and "job_state" in result.stdout:
            return job_state_from_qstat(result.stdout)
        output = tool_output(result)
        if result.returncode == 0 or not output or "Unknown Job" in output or "Unknown job" in output:
            # PBS has forgotten the job (finished and purged, or never existed)
            return JobState(state=State.UNKNOWN, raw=output or f"qstat exit {result.returncode}")
        raise tool_failed(result)

    def _qstat(self, job_id: str):
        if self._has_x:
            result = run_tool(["qstat", "-x", "-f", job_id], timeout_s=self.timeout_s)
            if result.returncode == 0 or "Unknown option" not in tool_output(result):
                return result
            self._has_x = False
        return run_tool(["qstat", "-f", job_id], timeout_s=self.timeout_s)

    def cancel(self, job_id: str) -> None:
        result = run_tool(["qdel", job_id], timeout_s=self.timeout_s)
        if result.returncode != 0:
            raise tool_failed(result)
