"""A colocated job through the real tinker SDK on the production Ray runtime (docs/colocation.md): two
logical GPUs, each shared by a trainer rank and a CPU engine. RL steps (sample, importance_sampling
forward_backward, optim_step, save_weights_and_get_sampling_client) must see the engines release their
memory for training and take it back for sampling, and the engines must sample with exactly the trainer's
weights after each step (pushed over shared memory, rank i to engine i, no weight-update group).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
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


def test_rl_steps_on_shared_gpus_sample_with_the_trainers_weights(gateway: GatewayProcess) -> None:
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()
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
        assert (engine, "ready", "released") in engines or (engine, "pending_weights", "released") in engines
        assert (engine, "released", "pending_weights") in engines
    phases = [r["phase"] for r in records if r.get("kind") == "colocation"]
    assert phases.count("training") >= 2 and phases.count("sampling") >= 2
    assert "unsettled" not in phases
    pushes = [r for r in records if r.get("kind") == "push" and r.get("push") == "ipc"]
    assert len(pushes) >= 3 and all(p["engines"] == 2 for p in pushes)  # bring-up + one per step
