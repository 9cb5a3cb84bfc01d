"""A colocated LoRA job through the real tinker SDK (docs/colocation.md): the engines release only their
KV cache while the trainer works (their base weights never change), take it back for sampling with no
push, and sample each step's adapter snapshot with the trainer's logprobs."""

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

KEY = "tml-colocated-lora-0001"
PROMPT = [3, 17, 90, 4, 55, 21]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("gateway-colocated-lora")
    proc = start_ray_gateway(
        tiny_model_dir, workdir, {KEY: "alpha"}, "--set", "colocate.enabled=true", "--set", "gpus_per_node=1"
    )
    yield proc
    proc.stop()


def test_lora_steps_release_the_kv_cache_only_and_sample_each_snapshot(gateway: GatewayProcess) -> None:
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    for step in range(2):
        sampler = tc.save_weights_and_get_sampling_client(f"lora-{step}").result()
        seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        full = PROMPT + list(seq.tokens)
        pad = [0.0] * (len(PROMPT) - 1)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": full[1:],
                "logprobs": pad + list(seq.logprobs or []),
                "advantages": pad + [1.0] * len(seq.tokens),
            },
        )
        out = tc.forward_backward([datum], "importance_sampling").result().loss_fn_outputs[0]
        np.testing.assert_allclose(seq.logprobs, out["logprobs"].to_numpy()[-len(seq.tokens) :], atol=2e-4)
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    records = list(read_events(gateway.workdir))
    engine = [(r["old"], r["new"]) for r in records if r.get("kind") == "engine"]
    assert engine.count(("pending_weights", "released")) >= 2
    assert engine.count(("released", "pending_weights")) >= 2
    phases = [r["phase"] for r in records if r.get("kind") == "colocation"]
    assert phases.count("training") >= 2 and phases.count("sampling") >= 1 and "unsettled" not in phases
    pushes = [r.get("push") for r in records if r.get("kind") == "push"]
    assert "ipc" not in pushes and "full" not in pushes  # LoRA: adapters load from disk, no weight push
    assert pushes.count("adapter") >= 2
