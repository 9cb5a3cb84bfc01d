"""Parsers of scheduler output, on samples captured from the local Slurm cluster (Slurm 22.05 + Torque
wrappers) and, where it differs, PBS Professional's documented output."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.schedulers.base import SchedulerError, State
from launcher.schedulers.pbs import (
    finished_state,
    job_state_from_qstat,
    parse_qstat_full,
    parse_qsub_output,
    pbs_bin_dir,
    pbs_command,
    pbs_exec_from_conf,
    project_problems,
)
from launcher.schedulers.slurm import (
    cancel_error,
    job_state_from_scontrol,
    parse_exit_code,
    parse_sbatch_output,
    parse_squeue_state,
    slurm_state,
)

SCONTROL_FAILED_ONELINE = (
    "JobId=2 JobName=fail.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-11-29T08:27:44 EligibleTime=2026-11-29T08:27:44 AccrueTime=2026-11-29T08:27:44 "
    "StartTime=2026-11-29T08:27:45 EndTime=2026-11-29T08:27:45 Deadline=N/A SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-29T08:27:45 Scheduler=Main Partition=debug "
    "AllocNode:Sid=localhost:4919 ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 BatchHost=node1 "
    "NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=/tmp/l2cap/fail.sh WorkDir=/tmp/l2cap StdErr=/tmp/l2cap/slurm-2.out StdIn=/dev/null "
    "StdOut=/tmp/l2cap/slurm-2.out Power= \n"
)

SCONTROL_RUNNING = """JobId=3 JobName=long.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901757 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2026-11-29T08:27:44 EligibleTime=2026-11-29T08:27:44
   NodeList=node1
   BatchHost=node1
   Command=/tmp/l2cap/long.sh
   Power=
"""

SCONTROL_CANCELLED = """JobId=3 JobName=long.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901757 Nice=0 Account=(null) QOS=(null)
   JobState=CANCELLED Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15
"""

SCONTROL_PENDING = """   JobState=PENDING Reason=Resources Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
"""

QSTAT_F_RUNNING = """Job Id:\t4
\tJob_Name = ptest
\tJob_Owner = root@localhost
\tjob_state = R
\tqueue = debug
\tqtime = Sun Nov 29 08:27:55 2026
\tmtime = Sun Nov 29 08:27:56 2026
\tctime = Sun Nov 29 08:32:56 2026
\texec_host = node1/1+node2/1
\tPriority = 4294901756
\teuser = root(0)
\tegroup = root(0)
\tResource_List.walltime = 00:05:00
\tResource_List.nodect = 2
\tResource_List.ncpus = 2

"""

QSTAT_F_DONE_WRAPPER = QSTAT_F_RUNNING.replace("job_state = R", "job_state = C")
QSTAT_F_QUEUED = QSTAT_F_RUNNING.replace("job_state = R", "job_state = Q")

# PBS Pro `qstat -x -f`: finished state F, Exit_status, a value wrapped onto a tab-indented line
QSTAT_XF_PBSPRO = """Job Id: 1234.pbs1
    Job_Name = tiny
    Job_Owner = user@login1
    job_state = F
    queue = rt_HF
    exec_host = hnode001/0*192+hnode002/0*192
    Variable_List = PBS_O_HOME=/home/user,PBS_O_LANG=C.UTF-8,PBS_O_LOGNAME=user,
\tPBS_O_PATH=/usr/bin:/bin,PBS_O_SHELL=/bin/bash
    Exit_status = 3
    Resource_List.select = 2
"""


@pytest.mark.parametrize(
    ("stdout", "job_id"),
    [("1\n", "1"), ("12;cluster1\n", "12"), ("Submitted batch job 2\n", "2"), ("sbatch: warn\n77\n", "77")],
)
def test_sbatch_job_id(stdout: str, job_id: str) -> None:
    assert parse_sbatch_output(stdout) == job_id


def test_sbatch_without_id_keeps_output() -> None:
    with pytest.raises(SchedulerError, match="invalid partition"):
        parse_sbatch_output("sbatch: error: invalid partition specified: nosuch\n")


@pytest.mark.parametrize(
    ("text", "state", "exit_code"),
    [
        (SCONTROL_FAILED_ONELINE, State.FAILED, 3),
        (SCONTROL_RUNNING, State.RUNNING, None),
        (SCONTROL_CANCELLED, State.CANCELLED, 128 + 15),
        (SCONTROL_PENDING, State.PENDING, None),
    ],
)
def test_scontrol_states(text: str, state: State, exit_code: int | None) -> None:
    job = job_state_from_scontrol(text)
    assert (job.state, job.exit_code) == (state, exit_code)


def test_scontrol_without_jobstate_is_an_error() -> None:
    with pytest.raises(SchedulerError, match="Invalid job id"):
        job_state_from_scontrol("slurm_load_jobs error: Invalid job id specified")


@pytest.mark.parametrize(
    ("word", "state"),
    [
        ("COMPLETING", State.RUNNING),
        ("CANCELLED by 0", State.CANCELLED),
        ("TIMEOUT", State.TIMEOUT),
        ("NODE_FAIL", State.FAILED),
        ("OUT_OF_MEMORY", State.FAILED),
        ("REQUEUED", State.PENDING),
        ("WHATEVER", State.UNKNOWN),
    ],
)
def test_slurm_state_words(word: str, state: State) -> None:
    assert slurm_state(word) == state


def test_exit_code_signal_and_garbage() -> None:
    assert parse_exit_code("0:0") == 0
    assert parse_exit_code("3:0") == 3
    assert parse_exit_code("0:9") == 137
    assert parse_exit_code("n/a") is None


def test_squeue_state() -> None:
    assert parse_squeue_state("9|PENDING\n", "9").state == State.PENDING
    assert parse_squeue_state("3|RUNNING\n", "3").state == State.RUNNING
    assert parse_squeue_state("", "3") is None


def test_scancel_verbose_errors() -> None:
    ok = "scancel: Terminating job 10\n"
    gone = (
        "scancel: Terminating job 999\nscancel: error: Kill job error on job id 999: Invalid job id specified"
    )
    assert cancel_error(0, ok) is None
    assert "Invalid job id" in (cancel_error(0, gone) or "")
    assert cancel_error(1, "boom") == "boom"


@pytest.mark.parametrize(
    ("stdout", "job_id"), [("4\n", "4"), ("1234.pbs1\n", "1234.pbs1"), ("12[].pbs1", "12[].pbs1")]
)
def test_qsub_job_id(stdout: str, job_id: str) -> None:
    assert parse_qsub_output(stdout) == job_id


def test_qsub_error_on_stdout_is_kept() -> None:
    wrapper_error = (
        "There was an error running the Slurm sbatch command.\nThe command was:\n"
        "'/usr/bin/sbatch -e bad.pbs.e%A -o bad.pbs.o%A bad.pbs 2>&1'\nand the output was:\n"
        "'sbatch: invalid option -- 'P'\n sbatch: error: Unrecognized command line parameter ?\n'\n"
    )
    with pytest.raises(SchedulerError, match="invalid option -- 'P'"):
        parse_qsub_output(wrapper_error)


def test_qstat_full_attributes_and_wrapped_values() -> None:
    attrs = parse_qstat_full(QSTAT_XF_PBSPRO)
    assert attrs["Job Id"] == "1234.pbs1"
    assert attrs["Variable_List"].endswith(
        "PBS_O_LOGNAME=user,PBS_O_PATH=/usr/bin:/bin,PBS_O_SHELL=/bin/bash"
    )
    assert parse_qstat_full(QSTAT_F_RUNNING)["exec_host"] == "node1/1+node2/1"


@pytest.mark.parametrize(
    ("text", "state", "exit_code"),
    [
        (QSTAT_F_RUNNING, State.RUNNING, None),
        (QSTAT_F_QUEUED, State.PENDING, None),
        (QSTAT_F_DONE_WRAPPER, State.COMPLETED, None),
        (QSTAT_XF_PBSPRO, State.FAILED, 3),
    ],
)
def test_qstat_states(text: str, state: State, exit_code: int | None) -> None:
    job = job_state_from_qstat(text)
    assert (job.state, job.exit_code) == (state, exit_code)


def test_pbs_finished_exit_statuses() -> None:
    assert finished_state(0) == State.COMPLETED
    assert finished_state(-29) == State.TIMEOUT
    assert finished_state(256 + 15) == State.CANCELLED
    assert finished_state(128 + 15) == State.CANCELLED  # qdel reached the job script's SIGTERM trap
    assert finished_state(1) == State.FAILED


PBS_CONF = """# written by the installer
PBS_EXEC=/opt/pbs-old
PBS_SERVER=pbshead
PBS_EXEC=/opt/pbs
PBS_HOME=/var/spool/pbs
"""


def test_pbs_commands_come_from_pbs_exec_not_path(tmp_path: Path) -> None:
    assert pbs_exec_from_conf(PBS_CONF) == "/opt/pbs"  # the last assignment wins, as when sourced
    assert pbs_exec_from_conf("PBS_SERVER=x\n") is None
    conf = tmp_path / "pbs.conf"
    conf.write_text(PBS_CONF.replace("/opt/pbs\n", f"{tmp_path}\n"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "qsub").write_text("#!/bin/sh\n")
    env = {"PBS_CONF_FILE": str(conf), "PATH": "/usr/bin"}
    assert pbs_bin_dir(env) == tmp_path / "bin"
    assert pbs_command("qsub", pbs_bin_dir(env)) == str(tmp_path / "bin" / "qsub")
    with pytest.raises(SchedulerError, match="MILES_PBS_BIN"):
        pbs_command("qdel", pbs_bin_dir(env))  # named, never silently taken from PATH
    assert pbs_bin_dir({"MILES_PBS_BIN": "/elsewhere", "PBS_CONF_FILE": str(conf)}) == Path("/elsewhere")
    assert pbs_bin_dir({"PBS_CONF_FILE": str(tmp_path / "missing.conf")}) is None


def test_pbs_project_placeholder_and_requirement_are_refused() -> None:
    (placeholder,) = project_problems("YOUR_ABCI_GROUP", project_required=True)
    assert "placeholder" in placeholder and "--set scheduler.pbs.project=" in placeholder
    assert "required" in project_problems(None, project_required=True)[0]
    assert project_problems(None, project_required=False) == []
    assert project_problems("gaa50001", project_required=True) == []
