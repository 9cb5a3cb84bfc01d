"""Run a tools/fork reproduction on a cluster node and bring its JSON report back (`--submit slurm|pbs`).

The reproduction runs on the node exactly as it runs here (its own process, local mode, `--json FILE`);
only the way there differs:

  slurm  submitit's Slurm executor: it pickles `run_tool_on_node`, writes and submits its own sbatch
         script, keeps the job's stdout/stderr files and hands back the function's return value (or its
         exception with the node's traceback). Job state: see `ScontrolWatcher`.
  pbs    PBS Professional has no submitit executor, so a plain generated script (every word quoted) is
         sent with PBS's own qsub (found as the launcher finds it: PBS_EXEC in pbs.conf), followed with
         the launcher's qstat parser, and the report is read from the job's folder.

The job folder (scripts, logs, report) must be on a filesystem the nodes share.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.schedulers.base import JobState
from launcher.schedulers.pbs import PbsScheduler, pbs_bin_dir, pbs_command
from launcher.schedulers.slurm import parse_scontrol_job
from miles.contract.walltimes import pbs_walltime, slurm_time

SUBMIT_MODES = ("local", "slurm", "pbs")
REPORT_NAME = "report.json"
NODE_FILE = "node.txt"  # the PBS job writes its host name here
# the node names each scheduler gives a job (the local Slurm cluster's nodes share one real host name)
NODE_ENV = ("SLURMD_NODENAME",)


@dataclass(frozen=True)
class NodeRequest:
    """What the job asks for: one node's worth of CPUs for `time`, in a partition (Slurm) or queue (PBS)."""

    folder: Path
    time: str
    cpus: int
    partition: str | None = None
    name: str = "miles-repro"


class NodeRunFailed(RuntimeError):
    """The reproduction did not finish on the node; the message carries the job's own output."""


def run_tool_on_node(python: str, tool: str, argv: Sequence[str], report: str) -> dict[str, Any]:
    """On the node: run the reproduction in its own process, return its report and where it ran."""
    proc = subprocess.run([python, tool, *argv, "--json", report], check=False)
    if proc.returncode != 0:
        raise NodeRunFailed(
            f"{Path(tool).name} exited {proc.returncode} on {node_name()} (its output is in the job's log)"
        )
    return {"node": node_name(), "report": json.loads(Path(report).read_text())}


def node_name() -> str:
    for name in NODE_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return socket.gethostname()


# ----- Slurm, through submitit ---------------------------------------------------------------------------


def submit_slurm(tool: Path, argv: Sequence[str], request: NodeRequest) -> dict[str, Any]:
    """Send the reproduction through submitit's Slurm executor and wait for its result object."""
    limit = slurm_time(request.time)  # a bad --time stops here, before any file or sbatch
    import cloudpickle
    import submitit

    # this module is not importable on the node (tools/fork is no package): pickle its function by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = submitit.SlurmExecutor(folder=request.folder / "%j")
    params: dict[str, Any] = {"job_name": request.name, "time": limit}
    params |= {"cpus_per_task": request.cpus, "nodes": 1, "ntasks_per_node": 1}
    if request.partition:
        params["partition"] = request.partition
    executor.update_parameters(**params)
    report = request.folder / "%j" / REPORT_NAME  # %j: submitit's job id placeholder
    job = executor.submit(_run_in_job_folder, sys.executable, str(tool), list(argv), str(report))
    job.watcher = scontrol_watcher()
    print(f"submitted Slurm job {job.job_id}; logs: {job.paths.stdout}", flush=True)
    try:
        return job.result()
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
        raise NodeRunFailed(f"Slurm job {job.job_id}: {exc}") from None
    except BaseException:
        job.cancel(check=False)  # interrupted here (Ctrl-C, SIGTERM): the job must not hold its node
        raise


def _run_in_job_folder(python: str, tool: str, argv: list[str], report: str) -> dict[str, Any]:
    job_id = os.environ.get("SLURM_JOB_ID", "job")
    return run_tool_on_node(python, tool, argv, report.replace("%j", job_id))


def scontrol_watcher(delay_s: int = 10) -> Any:
    """submitit's job-state tracking, fed by `scontrol show job` instead of `sacct`.

    submitit reads job states only from sacct, which needs Slurm's accounting database (slurmdbd): without
    it (many small clusters, the local test cluster) every state reads UNKNOWN, and a job that dies before
    writing its result (timeout, scancel, node failure) is waited for forever. scontrol answers from
    slurmctld itself, as the launcher's SlurmScheduler asks it, through the launcher's parser.
    """
    from submitit.slurm.slurm import SlurmInfoWatcher

    class ScontrolWatcher(SlurmInfoWatcher):
        def _make_command(self) -> list[str] | None:
            return ["scontrol", "-o", "show", "job"] if self._registered - self._finished else None

        def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
            return scontrol_states(string.decode() if isinstance(string, bytes) else string)

    return ScontrolWatcher(delay_s=delay_s)


def scontrol_states(text: str) -> dict[str, dict[str, str]]:
    """`scontrol -o show job` (one job a line) as submitit's watcher keeps states: {job id: {State: ...}}."""
    states = {}
    for line in text.splitlines():
        fields = parse_scontrol_job(line)
        if "JobId" in fields and "JobState" in fields:
            states[fields["JobId"]] = {"JobID": fields["JobId"], "State": fields["JobState"]}
    return states


# ----- PBS Professional, through a generated script ------------------------------------------------------


def pbs_script(python: str, tool: Path, argv: Sequence[str], report: Path, folder: Path) -> str:
    """The job script: a PBS job starts in $HOME, so it moves to the job folder first."""
    command = shlex.join([python, str(tool), *argv, "--json", str(report)])
    return "\n".join(
        [
            "#!/bin/bash",
            "# generated by tools/fork/node_submit.py; options are on the qsub command line",
            "set -euo pipefail",
            f"cd {shlex.quote(str(folder))}",
            f"hostname > {NODE_FILE}",
            "export OMP_NUM_THREADS=1",
            f"exec {command}",
            "",
        ]
    )


def qsub_argv(qsub: str, script: Path, request: NodeRequest, output: Path) -> list[str]:
    argv = [qsub, "-N", request.name, "-l", f"select=1:ncpus={request.cpus}"]
    argv += ["-l", f"walltime={pbs_walltime(request.time)}", "-j", "oe", "-o", str(output)]
    if request.partition:
        argv += ["-q", request.partition]
    return [*argv, str(script)]


def submit_pbs(
    tool: Path, argv: Sequence[str], request: NodeRequest, sleep: Callable[[float], None] = time.sleep
) -> dict[str, Any]:
    """qsub a generated script, follow the job with the launcher's qstat parser, read the report."""
    pbs_walltime(request.time)  # a bad --time stops here, before any file or qsub
    bin_dir = pbs_bin_dir()
    folder = request.folder / f"pbs-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    script, report, output = folder / "job.sh", folder / REPORT_NAME, folder / "job.out"
    qsub = qsub_argv(pbs_command("qsub", bin_dir), script, request, output)
    folder.mkdir(parents=True)
    script.write_text(pbs_script(sys.executable, tool, argv, report, folder))
    proc = subprocess.run(
        qsub,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
    )
    if proc.returncode != 0:
        raise NodeRunFailed(f"qsub refused the job: {(proc.stdout + proc.stderr).strip()}")
    job_id = proc.stdout.strip().splitlines()[-1]
    print(f"submitted PBS job {job_id}; output: {output}", flush=True)
    scheduler = PbsScheduler(bin_dir=bin_dir)
    try:
        state = wait_finished(scheduler.status, job_id, sleep)
    except BaseException:
        scheduler.cancel(job_id)  # interrupted here (Ctrl-C, SIGTERM): the job must not hold its node
        raise
    if state.exit_code != 0 or not report.is_file():
        raise NodeRunFailed(
            f"PBS job {job_id} ended {state.state} (exit {state.exit_code}):\n{_tail(output)}"
        )
    return {"node": (folder / NODE_FILE).read_text().strip(), "report": json.loads(report.read_text())}


def wait_finished(
    status: Callable[[str], JobState], job_id: str, sleep: Callable[[float], None], cap_s: float = 10.0
) -> JobState:
    """Poll until the job is finished, backing off from 1 s to `cap_s`."""
    delay = 1.0
    while True:
        state = status(job_id)
        if state.state.finished:
            return state
        sleep(delay)
        delay = min(delay * 1.5, cap_s)


def _tail(path: Path, lines: int = 30) -> str:
    # PBS copies the output file when the job has ended: allow it a moment to land
    for _ in range(10):
        if path.is_file():
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        time.sleep(0.5)
    return f"(no output file at {path})"
