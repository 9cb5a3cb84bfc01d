"""The whole product as one chain: `launcher submit` -> job -> Ray -> engines + trainer -> gateway -> the
real tinker SDK trains and samples -> the trainer dies -> healthz 503 -> the driver exits -> the job ends.

On the local scheduler (tiny-cpu) and on the real 3-node local Slurm cluster (sbatch); the PBS
Professional run is in test_pbs_jobs.py (real OpenPBS). Each job runs the real driver
(`python -m miles.driver.serve`), CPU engines and a tiny model built offline.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from jobtools import launcher, launcher_json, run_logs, wait_until
from stacktools import (
    assert_job_ended_after_trainer_death,
    kill_trainer,
    sample_twice,
    stack_preset,
    train_and_sample,
    wait_healthy,
)

from launcher.report import collect, dead_window
from launcher.runs import Run


def test_local_job_trains_samples_and_ends_when_the_trainer_dies(runs_dir: Path, write_preset) -> None:
    preset = write_preset(stack_preset("stack-local", nodes=1, runtime={"max_loaded_adapters": 1}))
    sub = launcher_json("submit", "--preset", str(preset), "--scheduler", "local")
    run_dir = Path(sub["run_dir"])
    try:
        status = wait_healthy(sub)
        assert status["phase"] == "serving"
        key_file = Path(status["api_key_file"])
        assert key_file == run_dir / "api_key" and key_file.stat().st_mode & 0o777 == 0o600
        assert key_file.read_text().startswith("tml-")
        training = train_and_sample(status, run_dir, "tiny-qwen3")
        # one adapter stays loaded: a second snapshot evicts the first, which reloads on its next use
        first_path = training.save_weights_for_sampler(name="first").result().path
        first = training.create_sampling_client(first_path).result()
        prompt = [5, 6, 7, 8]
        before = sample_twice(first, prompt)
        second = training.save_weights_and_get_sampling_client(name="second").result()
        sample_twice(second, prompt)
        assert sample_twice(first, prompt) == before  # same immutable snapshot, same seed, same tokens
        assert "unloading sampler adapter" in (run_dir / "logs" / "driver.log").read_text()

        kill_trainer(run_dir)
        assert_job_ended_after_trainer_death(sub, status, run_dir)
        assert_report_shows_the_death(sub["run_id"], run_dir)
        logs = launcher("logs", sub["run_id"], "--component", "driver")
        assert logs.returncode == 0 and "[driver]" in logs.stdout and "phase serving" in logs.stdout
        for component, line in (
            ("trainer-rank0", "trainer rank 0 of 1 ready"),
            ("engine-0", "Loading weights"),
        ):
            logs = launcher("logs", sub["run_id"], "--component", component)
            assert logs.returncode == 0 and f"[{component}]" in logs.stdout, logs.stdout + logs.stderr
            assert line in logs.stdout, logs.stdout
    finally:
        launcher("cancel", sub["run_id"])


def assert_report_shows_the_death(run_id: str, run_dir: Path) -> None:
    """The event log holds the run (training, pushes, the death, the driver's exit 3) and the report
    shows the death, the 503 window and the exit reason."""
    facts = collect(Run(run_dir))
    kinds = {e["kind"] for e in facts.events}
    assert {"phase", "train", "optim", "push", "engine", "trainer_dead"} <= kinds, kinds
    assert [e["code"] for e in facts.of_kind("driver_exit")] == [3]
    start, end = dead_window(facts) or (0.0, 0.0)
    assert start < end, facts.of_kind("trainer_dead", "driver_exit")  # healthz said 503 until the exit
    out = run_dir / "report-test.html"
    result = launcher("report", run_id, "-o", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    page = out.read_text()
    assert "exit 3 (trainer dead); trainer dead: trainer cell 0 errored: ActorDiedError" in page
    assert "healthz 503" in page  # the shaded window's legend entry in the timeline


def nodes_idle(timeout_s: float = 60) -> None:
    def idle() -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], capture_output=True, text=True, timeout=10)
        states = dict(line.split() for line in out.stdout.splitlines())
        return states.get("idle") == "3"

    wait_until(idle, timeout_s, "the 3 nodes to be idle again")


def test_slurm_job_full_finetune_push_aborted_by_trainer_death(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str]
) -> None:
    # full fine-tuning with small buckets and a gap between them, so a push is in flight when we kill
    preset = stack_preset(
        "stack-slurm",
        nodes=3,
        model={"train_mode": "full"},
        runtime={"push_bucket_mb": 0.1, "push_bucket_gap_s": 0.5},
    )
    sub = launcher_json("submit", "--preset", str(write_preset(preset)), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    status = wait_healthy(sub)
    rows = [line.split("\t") for line in (run_dir / "roles.tsv").read_text().splitlines()[1:]]
    assert "head" in rows[-1][-1] and "trainer" in rows[0][-1]
    cells = json.loads((run_dir / "cells.json").read_text())
    trainer_ip, head_ip = cells["trainer"][0]["node_ip"], rows[-1][2]
    assert trainer_ip == rows[0][2] != head_ip  # the trainer is never on the head of a multi-node job
    assert cells["trainer_commands"] == "channel"  # so the kill below ends a command in flight on it
    assert len(cells["engines"]) == 2
    training = train_and_sample(status, run_dir, "tiny-qwen3", rank=0)

    # a second sampler save pushes the full weights again: kill the trainer while buckets are in flight
    errors: list[BaseException] = []

    def save_again() -> None:
        try:
            training.save_weights_for_sampler(name="in-flight").result()
        except BaseException as exc:  # the push must fail: the trainer is gone
            errors.append(exc)

    saver = threading.Thread(target=save_again, daemon=True)
    driver_log = run_dir / "logs" / "driver.log"
    pushes_before = driver_log.read_text().count("pushed ")
    saver.start()
    time.sleep(2.5)  # the model is created and the push (8+ buckets, 0.5 s apart) is under way
    assert driver_log.read_text().count("pushed ") == pushes_before, "the push finished before the kill"
    kill_trainer(run_dir)
    assert_job_ended_after_trainer_death(sub, status, run_dir)
    text = driver_log.read_text()
    assert "aborted; no engine marked ready" in text, run_logs(run_dir)
    saver.join(30)
    fields = subprocess.run(["scontrol", "-o", "show", "job", sub["job_id"]], capture_output=True, text=True)
    assert "JobState=FAILED" in fields.stdout and "ExitCode=3:0" in fields.stdout
    nodes_idle()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # the SDK and httpx must reach the job's loopback gateway directly
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_cancel_shuts_the_driver_down_in_order(runs_dir: Path, write_preset) -> None:
    """`launcher cancel` (SIGTERM to the job, as scancel or walltime would): the driver stops the gateway,
    engines and trainer itself and exits 0; nothing of the job's process group survives."""
    sub = launcher_json("submit", "--preset", str(write_preset(stack_preset("stack-cancel", nodes=1))))
    run_dir = Path(sub["run_dir"])
    try:
        wait_healthy(sub)
        cancelled = launcher_json("cancel", sub["run_id"])
        assert cancelled["state"] == "CANCELLED"
        driver_log = (run_dir / "logs" / "driver.log").read_text()
        assert "shutdown requested" in driver_log, run_logs(run_dir)
        assert "exit status 0" in driver_log.split("phase stopped")[-1]
        assert "engine cell 0: ready -> stopped" in driver_log
        assert "trainer cell 0: alive -> stopped" in driver_log
        phases = [e["phase"] for e in collect(Run(run_dir)).of_kind("phase")]
        assert phases[0] == "ray" and phases[-2:] == ["stopping", "stopped"], phases
    finally:
        launcher("cancel", sub["run_id"])
