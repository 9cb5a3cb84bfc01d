"""A session trace of a real LoRA trainer and CPU engine through the tinker SDK: each forward_backward has
its trainer rank's compute on a track of its own, the save for sampling its adapter load on the model's
push track, and each sample the engine's own generation time (SGLang's `e2e_latency`) with its token
counts, inside the gateway's Sample operation."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from miles.runtime.local import LocalRuntime
from miles.train.backends.transformers_backend import TransformersBackend
from tests.fast.local_gateway import cpu_engine, local_gateway

pytestmark = pytest.mark.slow

KEY = "tml-trace-engine-0001"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("trace-engine")
    with cpu_engine(tiny_model_dir, tmp / "engine.log") as engine:
        backend = TransformersBackend(str(tiny_model_dir), train_mode="lora")
        runtime = LocalRuntime(tiny_model_dir, model_name="tiny", engine=engine, backend=backend)
        with local_gateway(runtime, tmp / "ckpt", KEY) as url:
            yield url


def test_the_trace_shows_the_trainer_ranks_the_adapter_load_and_the_engine(served: str) -> None:
    service = tinker.ServiceClient(base_url=served, api_key=KEY)
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    client.forward_backward([datum], "cross_entropy").result()
    sampler = client.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    sampled = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, params).result()
    completion_tokens = sum(len(sequence.tokens) for sequence in sampled.sequences)
    session_id = service.holder.get_session_id()
    with urllib.request.urlopen(service.create_rest_client().export_session_trace(session_id).result()) as r:
        events = [e for e in json.load(r)["traceEvents"] if e["ph"] == "X"]

    def one(**match) -> dict:
        found = [e for e in events if all(e.get(k) == v or e["args"].get(k) == v for k, v in match.items())]
        assert len(found) == 1, (match, [e["name"] for e in events])
        return found[0]

    compute = one(name="compute", cat="stage")
    rank = one(cat="rank", rank=0)
    assert rank["name"] == "ForwardBackward" and rank["ts"] == compute["ts"]
    assert 0 < rank["dur"] <= compute["dur"] + 1  # the compute stage is the slowest rank's (here the only)
    saved = one(name="SaveWeightsForSampler", cat="operation")
    load = one(name="load_adapter", cat="push")
    assert saved["ts"] <= load["ts"] and load["ts"] + load["dur"] <= saved["ts"] + saved["dur"] + 1
    sample = one(name="Sample", cat="operation")
    generate = one(name="generate", cat="engine")
    assert generate["args"]["samples"] == 2 and generate["args"]["completion_tokens"] == completion_tokens
    assert generate["args"]["prompt_tokens"] == 3 and generate["args"]["engine"].startswith("http://")
    assert 0 < generate["dur"] <= sample["dur"]  # the engine's part of the gateway's Sample operation
