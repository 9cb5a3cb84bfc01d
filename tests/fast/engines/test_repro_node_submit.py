"""tools/fork/node_submit.py without a cluster: the PBS job script's quoting (run by bash here, as a MoM
would), the scontrol states fed to submitit's watcher, the wait loop, and bad --time values refused before
anything is written or submitted. The jobs themselves: tests/system/test_repro_on_nodes.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.schedulers.base import JobState, State

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools" / "fork"))

import node_submit  # noqa: E402 - tools/fork is no package

TOOL = REPO / "tools" / "fork" / "keepalive_race_repro.py"

# `scontrol -o show job` on the local Slurm cluster (one job a line; fields cut for length)
SCONTROL = (
    "JobId=33 JobName=keepalive-repro UserId=root(0) JobState=COMPLETED Reason=None Requeue=1 Restarts=0 "
    "ExitCode=0:0 RunTime=00:00:09 TimeLimit=00:05:00 Partition=debug NodeList=node1 BatchHost=node1\n"
    "JobId=34 JobName=keepalive-repro JobState=CANCELLED Reason=None ExitCode=0:15 NodeList=node2\n"
    "JobId=35 JobName=other JobState=PENDING Reason=Resources NodeList=(null)\n"
)


def test_scontrol_states_are_what_submitits_watcher_keeps() -> None:
    states = node_submit.scontrol_states(SCONTROL)
    assert {job: info["State"] for job, info in states.items()} == {
        "33": "COMPLETED",
        "34": "CANCELLED",
        "35": "PENDING",
    }
    assert node_submit.scontrol_states("No jobs in the system\n") == {}


def test_the_watcher_calls_a_job_done_from_scontrol_without_sacct() -> None:
    pytest.importorskip("submitit")
    watcher = node_submit.scontrol_watcher()
    watcher.register_job("34")
    watcher.register_job("35")
    assert watcher._make_command()[:3] == ["scontrol", "-o", "show"]
    watcher._info_dict.update(watcher.read_info(SCONTROL.encode()))
    assert watcher.is_done("34", mode="cache")  # cancelled before any result: done, not waited on forever
    assert not watcher.is_done("35", mode="cache")


def test_pbs_script_passes_every_word_through_unchanged(tmp_path: Path) -> None:
    folder = tmp_path / "job dir $(touch pwned)"
    folder.mkdir()
    tool = tmp_path / "echo_args.py"
    tool.write_text(
        "import json, sys\n"
        "argv = sys.argv[1:]\n"
        "json.dump(argv[:-2], open(argv[-1], 'w'))\n"  # drops --json REPORT, writes the rest to REPORT
    )
    words = ["--modes", "a b", "$(touch pwned)", "`touch pwned`", "it's", '"; touch pwned; "']
    report = folder / "report.json"
    script = node_submit.pbs_script(sys.executable, tool, words, report, folder)
    (tmp_path / "job.sh").write_text(script)
    proc = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text()) == words
    assert not list(tmp_path.rglob("pwned"))
    assert (folder / node_submit.NODE_FILE).read_text().strip()


def test_qsub_argv_names_resources_and_checks_the_walltime(tmp_path: Path) -> None:
    request = node_submit.NodeRequest(folder=tmp_path, time="00:10:00", cpus=2, partition="rt_HF")
    argv = node_submit.qsub_argv("/opt/pbs/bin/qsub", tmp_path / "job.sh", request, tmp_path / "job.out")
    assert argv[argv.index("-q") + 1] == "rt_HF"
    assert "select=1:ncpus=2" in argv and "walltime=00:10:00" in argv and argv[-1] == str(tmp_path / "job.sh")
    with pytest.raises(ValueError, match="minutes must be 0-59"):
        node_submit.qsub_argv(
            "qsub", tmp_path / "job.sh", request.__class__(tmp_path, "99:99:99", 2), tmp_path
        )


def test_wait_finished_backs_off_to_its_cap() -> None:
    answers = iter([State.PENDING, State.RUNNING, State.RUNNING, State.RUNNING, State.RUNNING, State.FAILED])
    slept: list[float] = []
    state = node_submit.wait_finished(
        lambda job: JobState(next(answers), raw="x", exit_code=1), "7", slept.append, cap_s=2.0
    )
    assert state.state is State.FAILED
    assert slept == [1.0, 1.5, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("mode,bad_time", [("pbs", "forever"), ("slurm", "99:99:99")])
def test_a_bad_time_is_refused_before_anything_is_submitted(tmp_path: Path, mode: str, bad_time: str) -> None:
    folder = tmp_path / "jobs"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--submit", mode, "--time", bad_time, "--folder", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PBS_CONF_FILE": str(tmp_path / "none")},
    )
    assert proc.returncode != 0
    assert f"{bad_time!r}" in proc.stderr and "Traceback" not in proc.stderr
    assert not folder.exists() or not any(folder.rglob("*.sh"))
