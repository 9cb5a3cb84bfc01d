"""`launcher selftest` end to end: the real CLI submits a short job on the preset's real pieces, the real
driver (miles.driver.selftest) writes its rows, the launcher adds its own and judges the job's end.

- the shipped tiny-cpu preset on the local scheduler: every row passes, the job ends itself (exit 3);
- the same preset with one piece broken (an engine flag, a taken port, a dead trainer): the right row
  fails, names its log and a hint into docs/troubleshooting.md, the later rows are `not run`, exit 1;
- 3 nodes on the real local Slurm cluster and on the real OpenPBS cluster (stack_preset, as test_stack.py
  and test_pbs_jobs.py run the real driver there): every row passes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jobtools import LAUNCHER, REPO, launcher, run_logs, wait_until
from pbstools import qstat_x
from stacktools import stack_preset

from miles.contract.selftest import STEP_NAMES

pytestmark = pytest.mark.slow

LOCAL_TIMEOUT_S = 180  # `launcher selftest --timeout`: tiny-cpu takes ~30 s on an idle 2-core machine
NODES_TIMEOUT_S = 240  # 3 nodes: queue, Ray on each node, 3 processes loading the model (stacktools READY_S)
FOLLOW_SLACK_S = 40  # past its own --timeout the launcher cancels the job and returns: this is plenty
SUBMITTED = re.compile(r"^(?P<run_id>\S+): submitted \w+ job (?P<job_id>\S+) \(self-test\)", re.M)
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens: a call that goes through it never arrives


@dataclass
class Selftest:
    returncode: int
    result: dict[str, Any]  # --json's answer; without --json, RUN_DIR/selftest.json (the same object)
    output: str  # stdout: the JSON, or the progress lines, the table and the failures
    progress: str  # stderr: the progress lines under --json

    @property
    def run_dir(self) -> Path:
        return Path(self.result["run_dir"])

    @property
    def rows(self) -> dict[str, dict[str, Any]]:
        return {row["step"]: row for row in self.result["rows"]}

    def why(self) -> str:
        """For assertion messages: the launcher's output and the run's logs."""
        return f"{self.output}\n{self.progress}\n{run_logs(self.run_dir)}"


class SelftestRunner:
    """Runs `launcher selftest` as an operator does; every run it submitted is cancelled at teardown (a
    no-op for a job that ended itself, which each of them should)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.run_ids: list[str] = []

    def __call__(
        self,
        preset: str,
        *args: str,
        scheduler: str = "local",
        as_json: bool = True,
        jobs: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = LOCAL_TIMEOUT_S,
    ) -> Selftest:
        stdout = self.out_dir / f"selftest-{len(self.run_ids)}.out"
        stderr = stdout.with_suffix(".err")
        argv = [*LAUNCHER, "selftest", "--preset", preset, "--scheduler", scheduler]
        argv += [*args, "--timeout", str(timeout_s), *(["--json"] if as_json else [])]
        full_env = {**os.environ, **(env or {})}
        with stdout.open("w") as out, stderr.open("w") as err:
            process = subprocess.Popen(argv, stdout=out, stderr=err, cwd=REPO, env=full_env)
            try:
                returncode: int | None = process.wait(timeout_s + FOLLOW_SLACK_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                returncode = None
        output, progress = stdout.read_text(), stderr.read_text()
        submitted = SUBMITTED.search(progress if as_json else output)
        if submitted:
            self.run_ids.append(submitted["run_id"])
            if jobs is not None:
                jobs.append(submitted["job_id"])
        assert returncode is not None, (
            f"launcher selftest still ran {FOLLOW_SLACK_S} s past its own --timeout {timeout_s}:\n"
            f"{output}\n{progress}"
        )
        if as_json:
            result = json.loads(output)
        else:
            run_dir = re.search(r"^  run dir: (.+)$", output, re.M)
            assert run_dir, output
            result = json.loads((Path(run_dir[1]) / "selftest.json").read_text())
        return Selftest(returncode, result, output, progress)

    def cancel_all(self) -> None:
        for run_id in self.run_ids:
            launcher("cancel", run_id)


@pytest.fixture
def selftest(runs_dir: Path, tmp_path: Path) -> Iterator[SelftestRunner]:
    runner = SelftestRunner(tmp_path)
    yield runner
    runner.cancel_all()


def statuses(test: Selftest) -> list[tuple[str, str]]:
    return [(row["step"], row["status"]) for row in test.result["rows"]]


def assert_failed_at(test: Selftest, step: str) -> dict[str, Any]:
    """Every row before `step` passed, `step` failed, every row after it was not run; exit 1; the job
    ended by itself (the launcher did not have to cancel it). The failed row."""
    index = STEP_NAMES.index(step)
    expected = [(name, "pass") for name in STEP_NAMES[:index]] + [(step, "fail")]
    expected += [(name, "not run") for name in STEP_NAMES[index + 1 :]]
    assert statuses(test) == expected, test.why()
    assert test.returncode == 1 and test.result["ok"] is False
    assert test.result["message"].startswith(f"self-test failed at `{step}`: ")
    assert test.result["cancelled"] is False and test.result["timed_out"] is False, test.result["notes"]
    return test.rows[step]


def roles(run_dir: Path) -> list[list[str]]:
    """roles.tsv's rows: [index, name, ip, roles]."""
    return [line.split("\t") for line in (run_dir / "roles.tsv").read_text().splitlines()[1:]]


def head_of(run_dir: Path) -> list[str]:
    return next(row for row in roles(run_dir) if "head" in row[3].split(","))


def assert_three_nodes_passed(test: Selftest) -> None:
    """A 3-node self-test's rows: all passed, on the 3 nodes of roles.tsv, never training on the head."""
    assert statuses(test) == [(name, "pass") for name in STEP_NAMES], test.why()
    assert test.returncode == 0 and test.result["ok"] is True
    assert test.result["job_exit_code"] == 3
    rows, run_dir = test.rows, test.run_dir
    nodes = roles(run_dir)
    names, ips = [row[1] for row in nodes], sorted(row[2] for row in nodes)
    head = head_of(run_dir)
    assert len(set(names)) == 3 and len(set(ips)) == 3, nodes
    detail = rows["nodes"]["detail"]
    assert detail.startswith("3 node(s): ") and f"(head {head[1]})" in detail, rows["nodes"]
    assert all(name in detail for name in names), rows["nodes"]
    assert rows["ray"]["detail"].startswith("3 node(s): ")
    assert sorted(node["ip"] for node in rows["ray"]["data"]["nodes"]) == ips, rows["ray"]
    assert all(ip in rows["ray"]["detail"] for ip in ips)
    collective = rows["collective"]["data"]
    assert (collective["ranks"], collective["backend"]) == (3, "gloo"), rows["collective"]
    assert rows["collective"]["detail"].startswith("3 rank(s) on 3 node(s), gloo: all_reduce")
    trainer = re.search(r"trainer on \['([\d.]+)'\]", rows["placement"]["detail"])
    assert trainer, rows["placement"]
    assert trainer[1] in ips and trainer[1] != head[2], (rows["placement"], head)  # never on the head
    assert rows["train"]["node"] == trainer[1]  # the row names rank 0's node
    assert rows["engine_api"]["detail"].count("generate+logprobs") == 2  # both engines, off the trainer
    assert rows["job_end"]["seconds"] is not None and 0 < rows["job_end"]["seconds"] < 60


# ---- the local scheduler, the shipped preset -------------------------------------------------------------


def test_tiny_cpu_passes_every_row_and_the_job_ends_itself(selftest: SelftestRunner) -> None:
    # a proxy exported on the node (as HPC sites do for hub downloads) must not carry the driver's own
    # calls to its gateway: the SDK's train step would hang in retries
    proxies = {name: DEAD_PROXY for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    test = selftest("tiny-cpu", env=proxies | {"NO_PROXY": "example.org"})
    assert statuses(test) == [(name, "pass") for name in STEP_NAMES], test.why()
    result, rows = test.result, test.rows
    assert test.returncode == 0 and result["ok"] is True
    assert result["message"] == f"self-test passed: {len(STEP_NAMES)} of {len(STEP_NAMES)} checks"
    assert (result["job_state"], result["job_exit_code"]) == ("FAILED", 3)  # TRAINER_DEAD, as intended
    assert result["cancelled"] is False and result["timed_out"] is False
    assert all(row["hint"] is None for row in result["rows"])

    kl = rows["kl"]["data"]
    assert abs(kl["kl_sample_train_v1"]) < kl["threshold"] and kl["tokens"] > 0, rows["kl"]
    assert "generate+logprobs" in rows["engine_api"]["detail"], rows["engine_api"]
    assert "generate+logprobs" in rows["engine_api"]["data"]["engines"][0]["calls_ms"]
    assert rows["train"]["data"]["tokens"] > 0 and rows["train"]["detail"].startswith("LoRA rank 8: ")
    # the adapter loaded by the push, then unloaded and loaded again on the engine (kl samples after it)
    push = rows["push"]["detail"]
    assert "adapter push" in push and "unload_lora_adapter" in push and "load_lora_adapter" in push, push
    killed_at = rows["watchdog"]["data"]["killed_at"]
    assert rows["kl"]["at"] <= killed_at <= rows["job_end"]["at"], rows["watchdog"]
    assert rows["watchdog"]["data"]["healthz_503_after_s"] < 60
    job_end = rows["job_end"]
    assert job_end["seconds"] is not None and 0 < job_end["seconds"] < 60, job_end  # it ended itself
    assert "exit code 3 (trainer dead)" in job_end["detail"]

    # the table is kept in the run dir: selftest.json is the same answer, selftest.jsonl every row
    saved = json.loads((test.run_dir / "selftest.json").read_text())
    assert saved["rows"] == result["rows"] and saved["ok"] is True
    assert result["result_file"] == str(test.run_dir / "selftest.json")
    lines = (test.run_dir / "selftest.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(STEP_NAMES)
    assert (test.run_dir / "exit_code").read_text().strip() == "3"
    for name in STEP_NAMES:  # each row went to stderr as it arrived
        assert re.search(rf"^✓ {name} +pass ", test.progress, re.M), test.progress


# ---- the local scheduler, one piece broken ---------------------------------------------------------------


def test_a_colocated_job_checks_the_switch_and_the_ipc_push(selftest: SelftestRunner) -> None:
    """The colocated preset with a tiny model of its shape: trainer and engine share one logical GPU, the
    push row goes through the release/resume switch and the IPC push, and the LoRA adapter cycle is not
    there (full fine-tuning)."""
    test = selftest(
        "qwen3-0.6b-shape-colocated",
        "--set",
        "model.init_shape=tiny",
        "--set",
        "ray.node_ip.mode=loopback-index",
    )
    assert statuses(test) == [(name, "pass") for name in STEP_NAMES], test.why()
    push = test.rows["push"]["detail"]
    assert "ipc push" in push and "switch to training" in push and "switch to sampling" in push, push
    assert "load_lora_adapter" not in push
    assert test.rows["train"]["detail"].startswith("full fine-tuning: ")
    assert abs(test.rows["kl"]["data"]["kl_sample_train_v1"]) < test.rows["kl"]["data"]["threshold"]


def test_an_engine_flag_it_refuses_fails_the_cells_row(selftest: SelftestRunner) -> None:
    test = selftest("tiny-cpu", "--set", "engines.server_args.max_running_requests=0")
    row = assert_failed_at(test, "cells")
    assert row["log"] == "logs/engine-0.log", row
    assert "max_running_requests" in row["detail"], row
    assert "max_running_requests" in (test.run_dir / row["log"]).read_text()  # the log says it too
    assert row["hint"].endswith("(docs/troubleshooting.md#self-test-row-cells)"), row
    assert test.result["job_exit_code"] == 2, test.why()  # STARTUP_FAILED: the driver ended the job


def test_a_taken_gateway_port_fails_the_nodes_row(selftest: SelftestRunner) -> None:
    # something listens on the port the preset pins: the job's claim on the head (this host) refuses it
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        test = selftest("tiny-cpu", "--set", f"gateway.port={port}", as_json=False)
    row = assert_failed_at(test, "nodes")
    head = head_of(test.run_dir)
    assert f"GATEWAY_PORT {port} (gateway.port" in row["detail"], row
    assert (row["node"], row["log"]) == (head[1], "logs/job.log"), row
    assert row["hint"].endswith("(docs/troubleshooting.md#port-clashes)"), row
    assert test.result["job_exit_code"] == 1, test.why()  # the job script stopped before the driver
    # the human output: each row as it arrived, the table, then the failure's node, log and hint
    output = test.output
    assert re.search(r"^✗ nodes +fail ", output, re.M), output
    assert f"nodes failed: {row['detail']}\n" in output
    assert f"\n  node: {head[1]}\n  log:  {test.run_dir / 'logs/job.log'}\n  hint: {row['hint']}\n" in output
    assert f"self-test failed at `nodes`: {row['detail']}" in output
    assert f"  table:   {test.run_dir / 'selftest.json'}" in output


def test_a_dead_trainer_fails_the_train_row(selftest: SelftestRunner) -> None:
    test = selftest("tiny-cpu", "--set", "selftest.drill=dead_trainer")
    row = assert_failed_at(test, "train")
    cells = json.loads((test.run_dir / "cells.json").read_text())
    assert row["node"] == cells["trainer"][0]["node_ip"], row
    assert "trainer cell 0 errored" in row["detail"], row
    assert row["hint"].endswith("(docs/troubleshooting.md#self-test-row-train)"), row
    log = (test.run_dir / row["log"]).read_text()
    assert "trainer cell 0 errored" in log, f"the row's log {row['log']} does not say why"
    assert test.result["job_exit_code"] == 6, test.why()  # SELFTEST_FAILED


# ---- 3 nodes on the real clusters ------------------------------------------------------------------------


def slurm_nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=10)
    return sorted(set(out.stdout.split()))


def test_slurm_three_nodes_pass_every_row(
    slurm_cluster, selftest: SelftestRunner, write_preset, slurm_jobs: list[str]
) -> None:
    preset = write_preset(stack_preset("selftest-slurm", nodes=3))
    test = selftest(str(preset), scheduler="slurm", jobs=slurm_jobs, timeout_s=NODES_TIMEOUT_S)
    assert_three_nodes_passed(test)
    assert sorted(row[1] for row in roles(test.run_dir)) == slurm_nodes()
    fields = subprocess.run(
        ["scontrol", "-o", "show", "job", test.result["job_id"]], capture_output=True, text=True, timeout=30
    )
    assert "JobState=FAILED" in fields.stdout and "ExitCode=3:0" in fields.stdout, fields.stdout

    def idle() -> bool:  # the job left nothing behind on the nodes
        out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], capture_output=True, text=True, timeout=10)
        return dict(line.split() for line in out.stdout.splitlines()).get("idle") == "3"

    wait_until(idle, 60, "the 3 nodes to be idle again")


# the kit's nodes have no GPUs: the presets' GPUs are logical; as test_pbs_jobs.on_pbs_nodes
PBS = {"queue": "rt_HF", "project": "testgrp", "launch": "pbsdsh", "ngpus": 0, "walltime": "00:08:00"}


def test_pbs_three_nodes_pass_every_row(
    pbs_cluster, selftest: SelftestRunner, write_preset, pbs_jobs: list[str]
) -> None:
    preset = stack_preset("selftest-pbs", nodes=3)
    preset["scheduler"]["pbs"] |= PBS
    preset["ray"]["node_ip"] = {"mode": "hostname"}  # 127.0.10.x
    for key in ("gcs_port", "client_server_port", "node_port_base", "worker_port_base"):
        preset["ray"].pop(key)  # every port claimed per job
    preset["gateway"].pop("port")
    preset["env"]["HF_HUB_OFFLINE"] = "1"  # PBS jobs do not inherit the submitting shell's environment
    test = selftest(str(write_preset(preset)), scheduler="pbs", jobs=pbs_jobs, timeout_s=NODES_TIMEOUT_S)
    assert_three_nodes_passed(test)
    assert sorted(row[1] for row in roles(test.run_dir)) == ["pbsnode1", "pbsnode2", "pbsnode3"]
    info = wait_until(
        lambda: (q := qstat_x(test.result["job_id"])).get("job_state") == "F" and q, 30, "qstat -x: F"
    )
    assert info["Exit_status"] == "3", test.why()
