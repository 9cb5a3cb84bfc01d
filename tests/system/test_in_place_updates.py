"""In-place weight updates through the real tinker SDK and the OpenAI route on the production Ray runtime
(full fine-tuning, runtime.push_update in_place): samples running while a save pushes new weights are
neither aborted nor sent again; they finish on the new weights, and the OpenAI answer says which weight
version sampled which tokens (SGLang 0.5.23's weight_versions). docs/weights.md "In-place updates"."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_ray_gateway

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY = "tml-in-place-updates-0001"
ROWS = [[3, 17, 90, 4, 55, 21], [8, 8, 300, 12]]
LONG = 1500  # tokens: the sample must still run when the save's push starts


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("gateway-in-place")
    extra = ("--train-mode", "full", "--set", "runtime.push_update=in_place")
    proc = start_ray_gateway(tiny_model_dir, workdir, {KEY: "alpha"}, *extra)
    yield proc
    proc.stop()


def _datum(tokens: list[int]) -> types.Datum:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _openai_completion(url: str, model: str, out: dict) -> None:
    body = {"model": model, "prompt": "one two", "max_tokens": LONG, "temperature": 1.0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    out["answer"] = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300).json()


def _sample_statuses(log: Path) -> list[int]:
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e["status"] for e in entries if e.get("path", "").endswith("/asample")]


def test_samples_in_flight_continue_across_an_in_place_push(gateway: GatewayProcess) -> None:
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()
    path = tc.save_weights_for_sampler("before").result().path  # named: the OpenAI route opens it by path
    sampler = service.create_sampling_client(model_path=path).result()
    long = types.SamplingParams(max_tokens=LONG, temperature=1.0, stop=[])
    in_flight = sampler.sample(types.ModelInput.from_ints(ROWS[0]), 1, long)
    answer: dict = {}
    openai = threading.Thread(target=_openai_completion, args=(gateway.url, path, answer))
    openai.start()
    time.sleep(0.5)  # both are sampling now

    tc.forward_backward([_datum(t) for t in ROWS], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    tc.save_weights_and_get_sampling_client().result()  # the push, while both samples run
    openai.join(300)

    seq = in_flight.result().sequences[0]
    assert len(seq.tokens) == LONG, "the SDK's sample ran to its end"
    assert 503 not in _sample_statuses(gateway.request_log), "nothing was aborted and sent again"
    assert "metadata" in answer["answer"], answer["answer"]
    metadata = answer["answer"]["metadata"]
    spans = metadata["weight_versions"]
    assert len(spans) == 2, f"the completion ran across the push: {spans}"
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG
    assert spans[0]["version"] != spans[1]["version"] == metadata["weight_version"]
