"""Elastic hybrid training in a real job on the local Slurm cluster (the real driver, CPU engines,
a tiny fp32 model): an RL-style loop through the tinker SDK (sample from the latest weights, then train
on the samples) with borrowing enabled completes, an engine was lent for a step and given back, and the
losses equal the same loop with borrowing off: the trainer alone on the same data. With the transformers
backend that is the model's own backend, to the last bits; with megatron (a DP 1 megatron lane built from
the core's distributed-optimizer state) the transformers trainer is the reference, to megatron's own
numerical distance from it."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from jobtools import launcher, launcher_json, run_logs
from stacktools import stack_preset, wait_healthy
from tinker import types

from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import AdamParams, Datum

pytestmark = [pytest.mark.system, pytest.mark.slow]

PROMPT = [5, 17, 300, 42, 9, 77]
IDLE_WINDOW_S = 3.0  # the first step waits this long after sampling (reward time): only it borrows
STEPS = 2
ADAM = {"learning_rate": 1e-3, "eps": 1e-4}  # docs/elastic.md: a tiny eps amplifies summation order


def completion_datum(prompt: list[int], completion: list[int]) -> types.Datum:
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    inputs = {"target_tokens": tokens[1:], "weights": weights}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def as_miles(datum: types.Datum) -> Datum:
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    inputs["target_tokens"] = inputs["target_tokens"].astype(np.int64)
    inputs["weights"] = inputs["weights"].astype(np.float32)
    return Datum(np.asarray(datum.model_input.to_ints(), dtype=np.int64), inputs)


def rl_loop(url: str, key: str) -> tuple[list[float], list[list[types.Datum]]]:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=0).result()  # full
    sampler = training.save_weights_and_get_sampling_client(name="step-0").result()
    losses, batches = [], []
    for step in range(STEPS):
        params = types.SamplingParams(max_tokens=6, seed=step, temperature=1.0)
        out = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params)
        data = [completion_datum(PROMPT, list(seq.tokens)) for seq in out.result().sequences]
        if step == 0:
            time.sleep(IDLE_WINDOW_S + 0.5)  # the engines idle for the window: the next step borrows
        fwd = training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(**ADAM)).result()
        losses.append(float(fwd.result().metrics["loss:sum"]))
        batches.append(data)
        sampler = training.save_weights_and_get_sampling_client(name=f"step-{step + 1}").result()
    return losses, batches


def trainer_alone(model_dir: Path, batches: list[list[types.Datum]]) -> list[float]:
    backend = TransformersBackend(str(model_dir), train_mode="full")
    losses = []
    for data in batches:
        out = backend.forward_backward("m", [as_miles(d) for d in data], "cross_entropy", {})
        backend.optim_step("m", AdamParams(**ADAM))
        losses.append(float(out.metrics["loss:sum"]))
    return losses


@pytest.mark.parametrize(("backend", "rtol"), [("transformers", 1e-5), ("megatron", 1e-4)])
def test_an_rl_loop_with_borrowing_matches_the_trainer_alone(
    slurm_cluster, runs_dir: Path, write_preset, slurm_jobs: list[str], backend: str, rtol: float
) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")
    elastic = {
        "enabled": True,
        "min_rollout_gpus": 1,
        "idle_window_s": IDLE_WINDOW_S,
        "max_hybrid_lanes": 1,
        "min_loan_s": 0.0,  # the loan ends when the queue drains, as the loop below expects
    }
    # one Slurm node (Ray starts once): a one-GPU trainer and two one-GPU engines on logical GPUs
    preset = stack_preset(
        f"elastic-slurm-{backend}",
        nodes=1,
        gpus_per_node=3,
        engines={"kind": "cpu", "per_node": 2},
        model={"train_mode": "full", "backend": backend},
        elastic=elastic,
    )
    preset["ray"]["num_cpus"] = 4  # three bundles of one CPU, and the lane's when the engine left
    sub = launcher_json("submit", "--preset", str(write_preset(preset)), "--scheduler", "slurm")
    slurm_jobs.append(sub["job_id"])
    run_dir = Path(sub["run_dir"])
    try:
        status = wait_healthy(sub)
        key = Path(status["api_key_file"]).read_text().strip()
        losses, batches = rl_loop(status["gateway_url"], key)
        np.testing.assert_allclose(losses, trainer_alone(run_dir / "model", batches), rtol=rtol)

        shown = launcher_json("status", sub["run_id"])["catalog"]["snapshot"]["elastic"]
        done = [(o["action"], o["ok"]) for o in shown["recent"]]
        assert done[:2] == [("borrow", True), ("return", True)], (shown, run_logs(run_dir))
        assert shown["lanes"] == ["core"] and len(shown["owners"]) == 2
        driver_log = (run_dir / "logs" / "driver.log").read_text()
        assert "elastic borrow engine engine cell" in driver_log and "lane lane-engine cell" in driver_log
        table = launcher("status", sub["run_id"])
        assert "elastic: GPU owners" in table.stdout, table.stdout + table.stderr
    finally:
        launcher("cancel", sub["run_id"])
