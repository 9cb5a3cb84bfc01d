"""How the scheduler classes call their tools: argv, errors that keep the tool's words, fallbacks.
The tools are small scripts on PATH that print captured real output (unit level; the system tests
use the real commands)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.schedulers.base import SchedulerError, State, run_tool
from launcher.schedulers.pbs import PbsScheduler
from launcher.schedulers.slurm import SlurmScheduler

QSUB_P_ERROR = (
    "There was an error running the Slurm sbatch command.\\nand the output was:\\n"
    "'sbatch: invalid option -- 'P''"
)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MILES_PBS_BIN", str(bin_dir))  # else PBS_EXEC of /etc/pbs.conf decides

    def tool(name: str, body: str) -> None:
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)

    return tool


def test_missing_tool_and_timeout(tools) -> None:
    with pytest.raises(SchedulerError, match="command not found"):
        run_tool(["no-such-scheduler-tool-xyz"])
    tools("slowtool", "sleep 5\n")
    with pytest.raises(SchedulerError, match=r"no answer within 0\.2 s"):
        run_tool(["slowtool"], timeout_s=0.2)


def test_qsub_error_on_stdout_reaches_the_user(tools, tmp_path: Path) -> None:
    tools("qsub", f'printf "{QSUB_P_ERROR}\\n"; exit 1\n')
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n")
    with pytest.raises(SchedulerError, match="invalid option -- 'P'") as err:
        PbsScheduler().submit(script, tmp_path)
    assert "exit 1" in str(err.value)


def test_qsub_gets_the_script_and_runs_in_the_run_dir(tools, tmp_path: Path) -> None:
    tools("qsub", 'echo "$PWD $*" > "$PWD/qsub.args"; echo 1234.pbs1\n')
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#PBS -P grp\n#PBS -q rt_HF\necho hi\n")
    job_id = PbsScheduler().submit(script, tmp_path)
    assert job_id == "1234.pbs1"
    assert (tmp_path / "qsub.args").read_text().strip() == f"{tmp_path} {script}"
    assert "#PBS -P grp" in script.read_text()  # PBS Professional reads -P from the script


def test_qstat_falls_back_without_x_and_remembers(tools, tmp_path: Path) -> None:
    log = tmp_path / "calls"
    tools(
        "qstat",
        f'echo "$*" >> {log}\n'
        'if [[ "$1" == -x ]]; then echo "Unknown option: x"; exit 2; fi\n'
        'printf "Job Id:\\t4\\n\\tjob_state = R\\n\\tqueue = debug\\n"\n',
    )
    sched = PbsScheduler()
    assert sched.status("4").state == State.RUNNING
    assert sched.status("4").state == State.RUNNING
    assert log.read_text().splitlines() == ["-x -f 4", "-f 4", "-f 4"]


def test_qstat_unknown_job(tools) -> None:
    tools("qstat", "exit 153\n")
    assert PbsScheduler().status("99").state == State.UNKNOWN
    tools("qstat", 'echo "qstat: Unknown Job Id 99.pbs1" >&2; exit 153\n')
    assert PbsScheduler().status("99.pbs1").state == State.UNKNOWN


def test_scontrol_forgotten_job_is_unknown(tools) -> None:
    tools("scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n')
    state = SlurmScheduler().status("999")
    assert state.state == State.UNKNOWN and "Invalid job id" in state.raw


def test_scancel_error_despite_exit_zero(tools) -> None:
    tools(
        "scancel",
        'echo "scancel: Terminating job $2" >&2\n'
        'echo "scancel: error: Kill job error on job id $2: Invalid job id specified" >&2\n',
    )
    with pytest.raises(SchedulerError, match="Invalid job id"):
        SlurmScheduler().cancel("999")


def test_sbatch_failure_keeps_its_message(tools, tmp_path: Path) -> None:
    tools("sbatch", 'echo "sbatch: error: invalid partition specified: nosuch" >&2; exit 1\n')
    with pytest.raises(SchedulerError, match="invalid partition specified: nosuch"):
        SlurmScheduler().submit(tmp_path / "job.sh", tmp_path)
