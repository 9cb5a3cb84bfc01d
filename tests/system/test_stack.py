"""The whole product as one chain: `launcher submit` -> job -> Ray -> engines + trainer -> gateway -> the
real tinker SDK trains and samples -> the trainer dies -> healthz 503 -> the driver exits -> the job ends.

On the local scheduler (tiny-cpu), on the real 3-node local Slurm cluster (sbatch) and through the PBS
template (qsub under the cluster's PBS environment, pbsdsh stand-in). Each job runs the real driver
(`python -m miles.serve`), CPU engines and a tiny model built offline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from jobtools import HELPERS, launcher, launcher_json, run_logs, system_preset, wait_until
from tinker import types

from miles.demo_client import conversation_to_datum, load_conversations, mean_token_loss

PBS_OPTIONS = {"pbs": {"project": "testgrp", "queue": "rt_HF", "walltime": "00:08:00", "launch": "pbsdsh"}}
READY_S = 240  # bring-up on a loaded 2-core machine: Ray, 3 processes loading the model, first weights


def stack_preset(name: str, nodes: int, **extra: Any) -> dict:
    """A system preset that runs the REAL driver (miles.serve) instead of the fake one."""
    preset = system_preset(name, nodes=nodes, train_nodes=1, scheduler_extra=extra.pop("scheduler", None))
    del preset["driver"]
    preset["gpus_per_node"] = 2 if nodes == 1 else 1  # one trainer rank; one engine per engine node
    preset["scheduler"]["slurm"]["time"] = "00:08:00"
    # the watchdog needs 3 x 2 s of 503s: the driver (3 s of 503, then exit 3) ends the job first
    preset["watchdog"] |= {"dead_probes": 3, "probe_interval_s": 2.0, "startup_timeout_s": READY_S}
    preset["ray"]["num_cpus"] = 2
    preset["ray"]["object_store_memory_mb"] = 100
    preset["runtime"] = {"trainer_probe_interval_s": 0.5} | extra.pop("runtime", {})
    preset["model"] |= extra.pop("model", {})
    preset |= extra
    return preset


def wait_healthy(sub: dict) -> dict:
    run_dir = Path(sub["run_dir"])

    def healthy() -> dict | None:
        status = launcher_json("status", sub["run_id"])
        assert status["state"] in ("PENDING", "RUNNING"), f"job ended early\n{run_logs(run_dir)}"
        serving = status["phase"] == "serving" and (status["healthz"] or {}).get("status_code") == 200
        return status if serving else None

    return wait_until(healthy, READY_S, f"healthz 200\n{run_logs(run_dir)}", interval_s=1.0)


def sample_twice(sampler: Any, prompt: list[int]) -> list[list[int]]:
    out = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5, seed=1),
    ).result()
    assert len(out.sequences) == 2
    assert all(0 < len(s.tokens) <= 5 and len(s.logprobs) == len(s.tokens) for s in out.sequences)
    return [list(s.tokens) for s in out.sequences]


def train_and_sample(status: dict, run_dir: Path, base_model: str) -> Any:
    """Three SFT steps through the SDK (the loss must fall), then a sample from the trained weights."""
    key = Path(status["api_key_file"]).read_text().strip()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "model"))
    data = [conversation_to_datum(tokenizer, m) for m in load_conversations(8)]
    service = tinker.ServiceClient(base_url=status["gateway_url"], api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    losses = []
    for _ in range(3):
        fwd = training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(mean_token_loss(fwd.result(), data))
    assert losses[-1] < losses[0], losses
    sampler = training.save_weights_and_get_sampling_client(name="after-3-steps").result()
    sample_twice(sampler, list(data[0].model_input.to_ints()[:6]))
    return training


def kill_trainer(run_dir: Path) -> int:
    cells = json.loads((run_dir / "cells.json").read_text())
    pid = int(cells["trainer"][0]["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def watch_healthz(url: str, seconds: float) -> list[tuple[int | None, str]]:
    """Probe healthz quickly for a while; (status, body) of every answer (None: no answer)."""
    seen: list[tuple[int | None, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url + "/api/v1/healthz", timeout=2)
            seen.append((answer.status_code, answer.text))
        except httpx.HTTPError:
            seen.append((None, ""))
        if len(seen) > 5 and all(code is None for code, _ in seen[-5:]):
            break  # the gateway is gone
        time.sleep(0.2)
    return seen


def assert_job_ended_after_trainer_death(sub: dict, status: dict, run_dir: Path) -> None:
    seen = watch_healthz(status["gateway_url"], 30)
    dead = [body for code, body in seen if code == 503]
    assert dead, f"healthz never answered 503 after the trainer died: {seen[:10]}\n{run_logs(run_dir)}"
    assert '"status":"unavailable"' in dead[0] and "trainer cell 0" in dead[0]
    final = wait_until(
        lambda: (s := launcher_json("status", sub["run_id"]))["state"] not in ("RUNNING", "PENDING") and s,
        90,
        f"the job to end\n{run_logs(run_dir)}",
    )
    assert (final["state"], final["exit_code"]) == ("FAILED", 3), run_logs(run_dir)
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert "trainer dead: trainer cell 0 errored: ActorDiedError" in driver_log
    assert "phase stopped" in driver_log, run_logs(run_dir)  # an orderly exit, not a kill
    assert "driver exited with status 3" in (run_dir / "logs" / "job.log").read_text()


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
    assert len(cells["engines"]) == 2
    training = train_and_sample(status, run_dir, "tiny-qwen3")

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


def test_pbs_job_trains_samples_and_ends_when_the_trainer_dies(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str]
) -> None:
    preset = write_preset(stack_preset("stack-pbs", nodes=3, scheduler=PBS_OPTIONS))
    env = {"PATH": f"{HELPERS / 'bin'}{os.pathsep}{os.environ['PATH']}"}  # the pbsdsh stand-in
    sub = launcher_json(
        "submit", "--preset", str(preset), "--scheduler", "pbs", "--pbs-project-on-command-line", env=env
    )
    slurm_jobs.append(sub["job_id"].split(".")[0])
    run_dir = Path(sub["run_dir"])
    status = wait_healthy(sub)
    assert "(pbs)" in (run_dir / "logs" / "job.log").read_text()
    train_and_sample(status, run_dir, "tiny-qwen3")
    kill_trainer(run_dir)
    assert_job_ended_after_trainer_death(sub, status, run_dir)
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
    finally:
        launcher("cancel", sub["run_id"])
