"""PBS Professional: qsub / qstat / qdel, with pure parsers of their output.

PBS's commands are found in `$MILES_PBS_BIN`, else `PBS_EXEC/bin` of pbs.conf (`$PBS_CONF_FILE`, else
/etc/pbs.conf), else on PATH: on a machine that also has Slurm's Torque wrappers (`slurm-wlm-torque`),
`/usr/bin/qsub` is Slurm's, not PBS's, so PATH order must not decide.
"""

from __future__ import annotations

import os
import re
import shutil
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
from miles.contract.exit_codes import EXIT_SIGTERM

_JOB_ID = re.compile(r"^\d+(?:\[\d*\])?(?:\.[\w.-]+)?$")
_WALLTIME_KILLED = -29  # PBS Pro JOB_EXEC_KILL_WALLTIME
_SIGNAL_BASE = 256  # PBS Pro reports "killed by signal s" as 256 + s
_SIGTERM = 15
PBS_BIN_ENV = "MILES_PBS_BIN"  # a directory holding qsub/qstat/qdel: wins over pbs.conf and PATH
PROJECT_PLACEHOLDER = "YOUR_ABCI_GROUP"

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
    if exit_status in (_SIGNAL_BASE + _SIGTERM, EXIT_SIGTERM):
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


def pbs_exec_from_conf(conf_text: str) -> str | None:
    """PBS_EXEC from the text of a pbs.conf (the last assignment wins, as when PBS sources it)."""
    found = None
    for line in conf_text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.strip() == "PBS_EXEC" and value.strip():
            found = value.strip().strip("'\"")
    return found


def pbs_bin_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where PBS's own qsub lives: $MILES_PBS_BIN, else PBS_EXEC/bin of pbs.conf; None = use PATH."""
    env = os.environ if env is None else env
    if env.get(PBS_BIN_ENV):
        return Path(env[PBS_BIN_ENV])
    conf = Path(env.get("PBS_CONF_FILE") or "/etc/pbs.conf")
    try:
        exec_dir = pbs_exec_from_conf(conf.read_text())
    except OSError:
        return None
    return Path(exec_dir) / "bin" if exec_dir else None


def pbs_command(name: str, bin_dir: Path | None) -> str:
    """The full path of a PBS command (qsub, qstat, qdel)."""
    if bin_dir is not None:
        candidate = bin_dir / name
        if not candidate.is_file():
            raise SchedulerError(
                f"{candidate} does not exist: set {PBS_BIN_ENV} to the directory of PBS's {name} "
                "(or fix PBS_EXEC in pbs.conf)"
            )
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise SchedulerError(
            f"{name} not found: no PBS_EXEC in pbs.conf and none on PATH (set {PBS_BIN_ENV})"
        )
    return found


def project_problems(project: str | None, project_required: bool) -> list[str]:
    """What stops a PBS submission before qsub is asked: a missing or placeholder project."""
    if project == PROJECT_PLACEHOLDER:
        return [
            f"scheduler.pbs.project is the placeholder {PROJECT_PLACEHOLDER}: set your group, "
            "e.g. --set scheduler.pbs.project=gaXXXXXX (`groups` on the login node lists yours)"
        ]
    if project_required and not project:
        return ["scheduler.pbs.project is required by this preset: --set scheduler.pbs.project=YOUR_GROUP"]
    return []


class PbsScheduler:
    name = "pbs"

    def __init__(
        self,
        extra_qsub_args: Sequence[str] = (),
        timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        bin_dir: Path | None = None,
    ):
        self.extra_qsub_args = list(extra_qsub_args)
        self.timeout_s = timeout_s
        self.bin_dir = bin_dir if bin_dir is not None else pbs_bin_dir()
        self._has_x = True  # qstat -x (PBS Pro); switched off on the first "Unknown option"

    def _tool(self, name: str) -> str:
        return pbs_command(name, self.bin_dir)

    def submit(self, script: Path, run_dir: Path) -> str:
        # qsub writes its output files (<script>.o<id>) into the working directory
        argv = [self._tool("qsub"), *self.extra_qsub_args, str(script)]
        result = run_tool(argv, timeout_s=self.timeout_s, cwd=run_dir)
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
        qstat = self._tool("qstat")
        if self._has_x:
            result = run_tool([qstat, "-x", "-f", job_id], timeout_s=self.timeout_s)
            if result.returncode == 0 or "Unknown option" not in tool_output(result):
                return result
            self._has_x = False
        return run_tool([qstat, "-f", job_id], timeout_s=self.timeout_s)

    def cancel(self, job_id: str) -> None:
        result = run_tool([self._tool("qdel"), job_id], timeout_s=self.timeout_s)
        if result.returncode != 0:
            raise tool_failed(result)
