"""A colocated job through the real tinker SDK on the production Ray runtime (docs/colocation.md): two
logical GPUs, each shared by a trainer rank and a CPU engine. RL steps (sample, importance_sampling
forward_backward, optim_step, save_weights_and_get_sampling_client) must see the engines release their
memory for training and take it back for sampling, and the engines must sample with exactly the trainer's
weights after each step (pushed over shared memory, rank i to engine i, no weight-update group); an engine
killed while released is replaced and sampling goes on meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_ray_gateway
from miles.contract.events import read_events

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY = "tml-colocated-0001"
PROMPT = [3, 17, 90, 4, 55, 21]
FIXED = [8, 8, 300, 12, 40, 7]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("gateway-colocated")
    proc = start_ray_gateway(
        tiny_model_dir,
        workdir,
        {KEY: "alpha"},
        "--train-mode",
        "full",
        "--set",
        "colocate.enabled=true",
        "--set",
        "colocate.trainer_offload=[optimizer, gradients]",
    )  # its event log (RUN_DIR/events.jsonl) is in workdir
    yield proc
    proc.stop()


def _datum(tokens: list[int], sampled: types.SampledSequence | None = None) -> types.Datum:
    if sampled is None:
        inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
    full = tokens + list(sampled.tokens)
    pad = [0.0] * (len(tokens) - 1)
    inputs = {
        "target_tokens": full[1:],
        "logprobs": pad + list(sampled.logprobs or []),
        "advantages": pad + [1.0] * len(sampled.tokens),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def _fixed_logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    return tc.forward([_datum(FIXED)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.fixture(scope="module")
def tc(gateway: GatewayProcess) -> tinker.TrainingClient:
    """The one full fine-tuning model (it owns the trainer for the module's tests)."""
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    return service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()


def test_rl_steps_on_shared_gpus_sample_with_the_trainers_weights(
    gateway: GatewayProcess, tc: tinker.TrainingClient
) -> None:
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    before = _fixed_logprobs(tc)
    for step in range(2):
        sampler = tc.save_weights_and_get_sampling_client(f"step-{step}").result()
        sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result().sequences
        data = [_datum(PROMPT, seq) for seq in sampled]
        outputs = tc.forward_backward(data, "importance_sampling").result().loss_fn_outputs
        for seq, out in zip(sampled, outputs, strict=True):
            trainer = out["logprobs"].to_numpy()[-len(seq.tokens) :]
            # the engine that sampled holds the trainer's weights (after step 0: the trained ones)
            np.testing.assert_allclose(seq.logprobs, trainer, atol=2e-4)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert float(np.abs(_fixed_logprobs(tc) - before).max()) > 1e-3  # the steps moved the weights

    records = list(read_events(gateway.workdir))
    engines = [(r["engine"], r["old"], r["new"]) for r in records if r.get("kind") == "engine"]
    for engine in (0, 1):  # both engines took turns with the trainer rank on their GPU
        assert (engine, "pending_weights", "released") in engines  # out of routing, then released
        assert (engine, "released", "pending_weights") in engines
    phases = [r["phase"] for r in records if r.get("kind") == "colocation"]
    assert phases.count("training") >= 2 and phases.count("sampling") >= 2
    assert "unsettled" not in phases
    to_sampling = [r["steps"] for r in records if r.get("kind") == "colocation" and r["phase"] == "sampling"]
    assert all({"resume", "push"} <= set(steps) for steps in to_sampling)  # where each switch's time went
    pushes = [r for r in records if r.get("kind") == "push" and r.get("push") == "ipc"]
    assert len(pushes) >= 3 and all(p["engines"] == 2 for p in pushes)  # bring-up + one per step


def _engine_pid(workdir: Path, index: int) -> int:
    """The pid listening on engine `index`'s port (RUN_DIR/cells.json names its URL)."""
    url = json.loads((workdir / "cells.json").read_text())["engines"][index]["url"]
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on {url}")


def test_an_engine_killed_while_released_is_replaced_and_sampling_goes_on(
    gateway: GatewayProcess, tc: tinker.TrainingClient
) -> None:
    tc.forward_backward([_datum(FIXED)], "cross_entropy").result()  # the GPUs are the trainer's now
    os.kill(_engine_pid(gateway.workdir, 1), signal.SIGKILL)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client("after-kill").result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    for _ in range(3):  # served by the engine that resumed, then by both
        seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        trainer = tc.forward([_datum(PROMPT, seq)], "importance_sampling").result().loss_fn_outputs[0]
        logprobs = trainer["logprobs"].to_numpy()[-len(seq.tokens) :]
        np.testing.assert_allclose(seq.logprobs, logprobs, atol=2e-4)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        engine1 = [(r["old"], r["new"]) for r in read_events(gateway.workdir) if r.get("engine") == 1]
        if ("pending_weights", "ready") in engine1[engine1.index(("released", "failed")) :]:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"engine 1 did not come back: {engine1}")
    assert engine1[engine1.index(("released", "failed")) + 1] == ("failed", "starting")
    assert httpx.get(f"{gateway.url}/api/v1/healthz", timeout=5).status_code == 200


def test_a_trainer_that_dies_holding_the_gpus_turns_healthz_503_and_samples_fail_fast(
    gateway: GatewayProcess, tc: tinker.TrainingClient
) -> None:
    """Last in the module: the trainer stays dead."""
    rank0 = json.loads((gateway.workdir / "cells.json").read_text())["trainer"][0]["pid"]
    tc.forward_backward([_datum(FIXED)], "cross_entropy").result()  # the GPUs are the trainer's
    os.kill(rank0, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError):
        tc.forward_backward([_datum(FIXED)], "cross_entropy").result()
    health = httpx.get(f"{gateway.url}/api/v1/healthz", timeout=5)
    assert health.status_code == 503 and "trainer" in health.json()["error"]
    # a sample needs the GPUs back from a trainer that cannot offload: an error now, not a hang
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    base = service.create_sampling_client(base_model=BASE_MODEL).result()
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="trainer"):
        base.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    assert time.monotonic() - started < 60
