"""The embedded scheduler: the job script runs on this machine, as its own process group.

`submit` starts a small supervisor (`python -m launcher.schedulers.local RUN_DIR SCRIPT`) as a new session,
so its pid is the group id of everything the job starts. The supervisor runs the script in that group,
sends its output to `logs/job.log`, and writes the script's exit status to `RUN_DIR/exit_code`.
Status comes from the supervisor's pid (checked against its start time, so a reused pid is not taken
for the job) and that file. Cancel sends SIGTERM to the group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher.schedulers.base import JobState, SchedulerError, State
from miles.contract.procs import process_start_ticks

LOCAL_JOB_FILE = "local-job.json"
EXIT_CODE_FILE = "exit_code"
CANCELLED_FILE = "cancelled"
DEFAULT_GRACE_S = 10.0
KILL_WAIT_S = 10.0  # a SIGKILLed process is gone once the kernel has torn it down


@dataclass(frozen=True)
class LocalJob:
    pid: int
    pgid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22: tells a reused pid apart


def is_alive(job: LocalJob) -> bool:
    ticks = process_start_ticks(job.pid)
    if ticks is None:
        if Path("/proc").is_dir():
            return False
        try:
            os.kill(job.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return job.start_ticks is None or ticks == job.start_ticks


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, dead but not yet reaped, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def state_of(alive: bool, exit_code: int | None, cancelled: bool) -> JobState:
    """Pure: the job state from what the run dir and the process table say."""
    if alive:
        return JobState(state=State.RUNNING, raw="running")
    if cancelled:
        return JobState(state=State.CANCELLED, raw="cancelled", exit_code=exit_code)
    if exit_code is None:
        return JobState(state=State.FAILED, raw="supervisor gone without an exit code")
    state = State.COMPLETED if exit_code == 0 else State.FAILED
    return JobState(state=state, raw=f"exit {exit_code}", exit_code=exit_code)


def read_exit_code(run_dir: Path) -> int | None:
    try:
        return int((run_dir / EXIT_CODE_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


class LocalScheduler:
    name = "local"

    def __init__(self, run_dir: Path | None = None, grace_s: float = DEFAULT_GRACE_S):
        self.run_dir = run_dir
        self.grace_s = grace_s

    def submit(self, script: Path, run_dir: Path) -> str:
        run_dir = run_dir.resolve()
        env = {"OMP_NUM_THREADS": "1", **os.environ, "MILES_RUN_DIR": str(run_dir)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.schedulers.local", str(run_dir), str(script.resolve())],
            cwd=run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # reap the supervisor when it ends, should this process outlive it (an API user, a test)
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()
        job = LocalJob(pid=proc.pid, pgid=proc.pid, start_ticks=process_start_ticks(proc.pid))
        _write_json(run_dir / LOCAL_JOB_FILE, asdict(job))
        self.run_dir = run_dir
        return str(proc.pid)

    def _job(self, job_id: str) -> tuple[LocalJob, Path]:
        if self.run_dir is None:
            raise SchedulerError("the local scheduler needs the run directory to find its job")
        try:
            data = json.loads((self.run_dir / LOCAL_JOB_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise SchedulerError(f"cannot read {self.run_dir / LOCAL_JOB_FILE}: {exc}") from exc
        job = LocalJob(**data)
        if str(job.pid) != job_id:
            raise SchedulerError(f"job {job_id} is not the job of {self.run_dir} (pid {job.pid})")
        return job, self.run_dir

    def status(self, job_id: str) -> JobState:
        job, run_dir = self._job(job_id)
        return state_of(is_alive(job), read_exit_code(run_dir), (run_dir / CANCELLED_FILE).exists())

    def cancel(self, job_id: str) -> None:
        job, run_dir = self._job(job_id)
        if not group_alive(job.pgid):
            return
        if is_alive(job):  # else the script has ended: only leftovers of its group remain to stop
            (run_dir / CANCELLED_FILE).write_text(f"{time.time():.3f}\n")
        _signal_group(job.pgid, signal.SIGTERM)
        if _wait_group_gone(job.pgid, self.grace_s):
            return
        _signal_group(job.pgid, signal.SIGKILL)
        if not _wait_group_gone(job.pgid, KILL_WAIT_S):
            raise SchedulerError(f"process group {job.pgid} still has live processes after SIGKILL")


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def supervise(run_dir: Path, script: Path) -> int:
    """Run the job script in this process group and record its exit status (the supervisor's body)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # SIGTERM reaches the whole group: the script handles it; we stay to record how it ended.
    # A handler (unlike SIG_IGN) is reset to the default in the script we exec.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with open(logs / "job.log", "ab") as log:
        child = subprocess.Popen(
            ["bash", str(script)],
            cwd=run_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        returncode = child.wait()
    code = returncode if returncode >= 0 else 128 - returncode
    tmp = run_dir / f"{EXIT_CODE_FILE}.tmp"
    tmp.write_text(f"{code}\n")
    os.replace(tmp, run_dir / EXIT_CODE_FILE)
    return code


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m launcher.schedulers.local RUN_DIR SCRIPT")
    sys.exit(supervise(Path(sys.argv[1]), Path(sys.argv[2])))
