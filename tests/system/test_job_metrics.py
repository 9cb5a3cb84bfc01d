"""/metrics after real work: the local-runtime gateway (one subprocess: trainer + CPU engine), driven by
the real tinker SDK, exports the job's training and sampling metrics with the model and tenant ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_gateway

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY = "tml-metrics-alpha-0001"
ROWS = [[5, 9, 14, 3, 7, 11], [4, 8, 15, 16, 23]]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = start_gateway(tiny_model_dir, tmp_path_factory.mktemp("gateway-metrics"), {KEY: "alpha"})
    yield proc
    proc.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def datum(tokens: list[int]) -> types.Datum:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_training_sampling_and_refusals_show_on_the_scrape(gateway: GatewayProcess) -> None:
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    data = [datum(row) for row in ROWS]
    out = tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [10**9, 2], "weights": [1.0, 1.0]},  # past the vocabulary
    )
    with pytest.raises(Exception, match=r"vocab|target"):
        tc.forward_backward([bad], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client(name="metrics-0").result()
    never_stop = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])
    sampler.sample(types.ModelInput.from_ints([5, 9, 14]), 2, never_stop).result()

    m = tc.model_id
    got = scrape(gateway.url)
    tokens = sum(len(row) - 1 for row in ROWS)
    assert got[("miles_train_command_seconds_count", (("command", "forward_backward"), ("model", m)))] == 2
    assert got[("miles_train_command_seconds_count", (("command", "optim_step"), ("model", m)))] == 1
    assert got[("miles_train_optim_steps_total", (("model", m),))] == 1
    assert got[("miles_train_tokens_total", (("model", m),))] == tokens  # the refused batch added none
    assert got[("miles_train_refusals_total", (("command", "forward_backward"), ("model", m)))] == 1
    loss = out.metrics["loss:sum"] / tokens  # every weight is 1
    assert got[("miles_train_loss", (("model", m),))] == pytest.approx(loss, rel=1e-5)
    assert got[("miles_train_tokens_per_second", (("model", m),))] > 0
    assert got[("miles_engine_generated_tokens_total", ())] == 2 * 4
    assert got[("miles_engine_requests_in_flight", ())] == 0
    assert got[("miles_gateway_model_tenant", (("model", m), ("tenant", "alpha")))] == 1
    assert got[("miles_gateway_queue_wait_seconds_count", (("model", m),))] >= 3
    assert got[("miles_gateway_queue_depth", (("model", m),))] == 0
