"""The real-driver stack in a job, for the system tests: its preset, waiting for healthz, training and
sampling through the tinker SDK, killing the trainer and checking that the job ended because of it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import tinker
from jobtools import launcher_json, run_logs, system_preset, wait_until
from tinker import types

from miles.demo_client import conversation_to_datum, load_conversations, mean_token_loss

READY_S = 240  # bring-up on a loaded 2-core machine: Ray, 3 processes loading the model, first weights


def stack_preset(name: str, nodes: int, **extra: Any) -> dict:
    """A system preset that runs the REAL driver (miles.driver.serve) instead of the fake one."""
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


def train_and_sample(status: dict, run_dir: Path, base_model: str, rank: int = 4) -> Any:
    """Three SFT steps through the SDK (the loss must fall), then a sample from the trained weights.
    rank 0: full fine-tuning (a job whose preset says model.train_mode: full)."""
    key = Path(status["api_key_file"]).read_text().strip()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "model"))
    data = [conversation_to_datum(tokenizer, m) for m in load_conversations(8)]
    service = tinker.ServiceClient(base_url=status["gateway_url"], api_key=key)
    training = service.create_lora_training_client(base_model=base_model, rank=rank).result()
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
