"""The OpenAI routes with the real `openai` client against a gateway subprocess (local runtime)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import tinker

from bench.gateway_process import BASE_MODEL, GatewayProcess, start_gateway

pytestmark = [pytest.mark.system, pytest.mark.slow]

KEY_A = "tml-openai-alpha-0001"
KEY_B = "tml-openai-bravo-0002"
CHAT = [{"role": "user", "content": "say something"}]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = start_gateway(
        tiny_model_dir, tmp_path_factory.mktemp("gateway-openai"), {KEY_A: "alpha", KEY_B: "bravo"}
    )
    yield proc
    proc.stop()


def _client(gateway: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_models_lists_the_base_model(gateway: GatewayProcess) -> None:
    assert BASE_MODEL in [m.id for m in _client(gateway).models.list()]


def test_chat_stream_and_non_stream_agree(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    done = client.chat.completions.create(model=BASE_MODEL, messages=CHAT, max_tokens=8, temperature=0)
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens >= 1 and done.usage.prompt_tokens > 1
    stream = client.chat.completions.create(
        model=BASE_MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_completions_stream_and_non_stream(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    done = client.completions.create(model=BASE_MODEL, prompt="one two", max_tokens=6, temperature=0, n=2)
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text  # greedy
    pieces = list(
        client.completions.create(
            model=BASE_MODEL, prompt="one two", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text


def _completion_entries(gateway: GatewayProcess) -> int:
    return sum(1 for r in gateway.requests() if r["path"] == "/v1/completions")


def test_stream_chunks_arrive_while_the_sample_is_still_running(gateway: GatewayProcess) -> None:
    """Ordering, not timing: the gateway writes a request's log entry as it sends the response's last
    byte, so at the first chunk a streamed completion must not be logged yet; a gateway that sampled to
    the end before sending would have."""
    client = _client(gateway)
    kwargs = {"model": BASE_MODEL, "prompt": "one two", "max_tokens": 300, "temperature": 1.0, "seed": 11}
    before = _completion_entries(gateway)
    chunks = iter(client.completions.create(stream=True, **kwargs))
    first = next(chunks)
    assert _completion_entries(gateway) == before, "the first chunk came after the sample had ended"
    rest = list(chunks)
    # The client stops at `data: [DONE]`; the response's final (empty) body message, at which the entry is
    # logged, may still be on its way.
    deadline = time.monotonic() + 10
    while _completion_entries(gateway) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _completion_entries(gateway) == before + 1
    assert len(rest) > 10 and rest[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.completions.create(**kwargs).choices[0]  # same seed: the same sample
    assert "".join(c.choices[0].text for c in [first, *rest]) == whole.text


def test_errors_bad_key_and_unknown_model(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "tml-not-a-real-key").chat.completions.create(model=BASE_MODEL, messages=CHAT)
    with pytest.raises(openai.NotFoundError) as err:
        _client(gateway).chat.completions.create(model="gpt-nope", messages=CHAT)
    assert "gpt-nope" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        _client(gateway).chat.completions.create(model=BASE_MODEL, messages=[])


def test_sampler_path_is_a_model_for_its_owner_only(gateway: GatewayProcess) -> None:
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY_A)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    path = tc.save_weights_for_sampler("openai-snap").result().path
    reply = _client(gateway).chat.completions.create(model=path, messages=CHAT, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None and reply.model == path
    assert path in [m.id for m in _client(gateway).models.list()]
    with pytest.raises(openai.NotFoundError):
        _client(gateway, KEY_B).chat.completions.create(model=path, messages=CHAT, max_tokens=4)
