"""Jobs on the real OpenPBS cluster (../shared/pbs-local: 3 MoMs, pbsnode1-3 at 127.0.10.1-3, one kernel).

`launcher` finds PBS's qsub/qstat/qdel through PBS_EXEC in /etc/pbs.conf, never Slurm's Torque wrappers
that come first in PATH here. Workers start through PBS's own TM interface (pbs_tmrsh, pbsdsh -n).
- a 3-node job with the real driver: Ray head last, trainer and engine on the other nodes, training and
  sampling through the tinker SDK; killing the trainer ends the job with Exit_status = 3 (as root);
- two 1-node jobs of one preset at once, as a normal user (MoM tracks and kills only non-root jobs):
  one is rerun (qrerun: the first attempt's run files move aside) and then qdel'ed (CANCELLED, the job's
  SIGTERM teardown), one outlives its walltime (TIMEOUT, same teardown); both claimed their own ports
  on the shared kernel.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jobtools import HELPERS, launcher_json, run_logs, system_preset, wait_until
from pbstools import pbs_tool, qstat_x, user_dir, user_launcher, user_python
from stacktools import (
    assert_job_ended_after_trainer_death,
    kill_trainer,
    stack_preset,
    train_and_sample,
    wait_healthy,
)

pytestmark = pytest.mark.slow

# the kit's nodes have no GPUs: the presets' GPUs are logical (Ray advertises them), PBS is asked for none
PBS = {"queue": "rt_HF", "project": "testgrp", "launch": "pbs_tmrsh", "ngpus": 0}


def on_pbs_nodes(preset: dict[str, Any], **pbs: Any) -> dict[str, Any]:
    """PBS options, node IPs from the host names (127.0.10.x), and every port claimed per job."""
    preset["scheduler"]["pbs"] = preset["scheduler"]["pbs"] | PBS | pbs
    preset["ray"]["node_ip"] = {"mode": "hostname"}
    for key in ("gcs_port", "client_server_port", "node_port_base", "worker_port_base"):
        preset["ray"].pop(key)
    preset["gateway"].pop("port")
    preset["env"]["HF_HUB_OFFLINE"] = "1"  # PBS jobs do not inherit the submitting shell's environment
    return preset


def test_three_node_job_trains_samples_and_exits_3_when_the_trainer_dies(
    pbs_cluster, runs_dir: Path, write_preset, pbs_jobs: list[str]
) -> None:
    preset = on_pbs_nodes(stack_preset("pbs-stack", nodes=3), walltime="00:08:00", launch="pbsdsh")
    sub = launcher_json("submit", "--preset", str(write_preset(preset)), "--scheduler", "pbs")
    pbs_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    script = Path(sub["script"]).read_text()
    assert "\n#PBS -l select=3\n#PBS -l place=scatter:excl\n" in script and "\n#PBS -P testgrp\n" in script
    status = wait_healthy(sub)

    rows = [line.split("\t") for line in (run_dir / "roles.tsv").read_text().splitlines()[1:]]
    names = [row[1] for row in rows]
    assert sorted(names) == ["pbsnode1", "pbsnode2", "pbsnode3"] and "head" in rows[-1][-1]
    job_log = (run_dir / "logs" / "job.log").read_text()
    assert f"nodes: {' '.join(sorted(names))} (head {names[-1]})" in job_log  # the head runs the script
    cells = json.loads((run_dir / "cells.json").read_text())
    assert cells["trainer"][0]["node_ip"] == rows[0][2] != rows[-1][2]  # never trains on the head
    assert cells["trainer_commands"] == "channel"  # the driver on the head reached the rank's own node IP
    assert {urlsplit(c["url"]).hostname for c in cells["engines"]} == {rows[1][2], rows[2][2]}
    for index in (0, 1):  # each worker's ray-node.sh ran on its own node through pbsdsh -n INDEX
        assert f"on {names[index]}," in (run_dir / "logs" / f"ray-worker-{index}.log").read_text()
    assert set(status["ports"]) == {"head", "node-0", "node-1", "node-2"}
    assert status["gateway_url"] == f"http://{rows[-1][2]}:{status['ports']['head']['GATEWAY_PORT']}"

    train_and_sample(status, run_dir, "tiny-qwen3")
    kill_trainer(run_dir)
    assert_job_ended_after_trainer_death(sub, status, run_dir)
    info = wait_until(lambda: (q := qstat_x(sub["job_id"])).get("job_state") == "F" and q, 30, "qstat -x: F")
    assert info["Exit_status"] == "3", run_logs(run_dir)
    assert sorted(info["exec_host"].replace("+", " ").replace("/0", "").split()) == sorted(names)


def user_job(runs: Path, name: str, walltime: str, rerunnable: bool = False) -> dict[str, Any]:
    preset = system_preset(name, nodes=1, train_nodes=1)
    preset["driver"]["command"] = [str(user_python()), str(HELPERS / "fake_driver.py")]
    preset = on_pbs_nodes(preset, walltime=walltime, rerunnable=rerunnable)
    path = runs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return user_launcher(runs, "submit", "--preset", str(path), "--scheduler", "pbs")


@pytest.fixture
def pbs_user_python() -> None:
    try:
        user_python()
    except RuntimeError as exc:
        pytest.skip(f"no python the PBS user can run: {exc}")


def test_user_jobs_qdel_and_walltime_end_in_order_with_their_own_ports(
    pbs_cluster, pbs_user_python, pbs_jobs: list[str]
) -> None:
    runs = user_dir("mpbs")
    cancelled = user_job(runs, "pbs-qdel", walltime="00:05:00", rerunnable=True)
    timed = user_job(runs, "pbs-walltime", walltime="00:01:15")  # past bring-up on a loaded machine
    pbs_jobs += [cancelled["job_id"], timed["job_id"]]
    for sub in (cancelled, timed):
        run_dir = Path(sub["run_dir"])
        healthy = run_dir / "healthy"
        wait_until(healthy.exists, 60, f"healthz 200\n{run_logs(run_dir)}")
    ports = [user_launcher(runs, "status", sub["run_id"])["ports"] for sub in (cancelled, timed)]
    heads = [set(p["head"].values()) for p in ports]
    nodes = [set(p["node-0"].values()) for p in ports]
    assert not heads[0] & heads[1] and not nodes[0] & nodes[1], ports  # one kernel, no shared port

    # a rerun (qrerun; a node failure or preemption does the same to a `-r y` job) starts again in the
    # same run dir: the first attempt's files move aside, the second attempt claims its own ports
    run_dir = Path(cancelled["run_dir"])
    assert "\n#PBS -r y\n" in Path(cancelled["script"]).read_text()
    subprocess.run([pbs_tool("qrerun"), cancelled["job_id"]], check=True, timeout=30)
    wait_until((run_dir / "attempts").is_dir, 60, f"the rerun to start\n{run_logs(run_dir)}")
    (aside,) = (run_dir / "attempts").iterdir()
    assert (aside / "healthy").exists() and (aside / "ports" / "head.env").is_file()
    wait_until((run_dir / "healthy").exists, 60, f"the rerun's healthz\n{run_logs(run_dir)}")
    assert "a previous attempt's run files moved to" in (run_dir / "logs" / "job.log").read_text()

    assert user_launcher(runs, "cancel", cancelled["run_id"])["cancelled"] is True
    for sub, state, exit_status in ((cancelled, "CANCELLED", ("143", "271")), (timed, "TIMEOUT", ("-29",))):
        run_dir = Path(sub["run_dir"])
        final = wait_until(
            lambda sub=sub: (
                (s := user_launcher(runs, "status", sub["run_id"]))["state"] not in ("RUNNING", "PENDING")
                and s
            ),
            90,
            f"the PBS job to end\n{run_logs(run_dir)}",
        )
        assert final["state"] == state, run_logs(run_dir)
        assert qstat_x(sub["job_id"])["Exit_status"] in exit_status
        # MoM signals the job script and the driver together: the script's teardown ran to its end
        job_log = (run_dir / "logs" / "job.log").read_text()
        assert "teardown (exit status 143)" in job_log, job_log
        assert (run_dir / "exit_code").read_text().strip() == "143"
        assert final["end_reason"] == "SIGTERM: cancelled, walltime or preemption"
