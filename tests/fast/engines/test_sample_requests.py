"""How a Tinker sample of `num_samples` sequences becomes /generate requests: unseeded samples go as one
request with SGLang's `n` (the engine admits them together and prefills the prompt once; 64 requests of an
RL step used to join the running batch one prefill at a time), seeded ones one request each (seed + i),
and the prompt-side logprobs ride with sample 0 only."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles.engines import sglang_client
from miles.engines.sglang_client import SGLangApiClient
from miles.rollout.sampling import sample_on_engine
from miles.types import LogprobSpec, SamplingParams
from tests.fast.engines.test_cpu_engine_api import PROMPT, client  # noqa: F401

PARAMS = SamplingParams(max_tokens=3, temperature=1.0, stop_strings=(), stop_token_ids=())


def _answer(tokens: list[int]) -> dict[str, Any]:
    logprobs = [[-0.5, t, None] for t in tokens]
    return {
        "output_ids": tokens,
        "meta_info": {"output_token_logprobs": logprobs, "finish_reason": {"type": "length"}},
    }


async def _sent(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, n: int, spec: LogprobSpec
) -> list[dict]:
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        count = body["sampling_params"].get("n", 1)
        if count == 1:
            single = _answer([1, 2, 3])
            if "logprob_start_len" in body:  # the prompt's own logprobs, from logprob_start_len on
                prompt = [5, 6, 7][body["logprob_start_len"] :]
                single["meta_info"]["input_token_logprobs"] = [[-0.1, t, None] for t in prompt]
            return httpx.Response(200, json=single)
        return httpx.Response(200, json=[_answer([1, 2, 3 + i]) for i in range(count)])

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    monkeypatch.setattr(sglang_client, "get_async_client", lambda purpose: http)
    out = await sample_on_engine(
        SGLangApiClient("http://engine"), [5, 6, 7], params, num_samples=n, logprobs=spec
    )
    assert len(out.sequences) == n
    await http.aclose()
    return bodies


async def test_unseeded_samples_go_as_one_request_with_n(monkeypatch: pytest.MonkeyPatch) -> None:
    (body,) = await _sent(monkeypatch, PARAMS, 8, LogprobSpec())
    assert body["sampling_params"]["n"] == 8 and "sampling_seed" not in body["sampling_params"]


async def test_seeded_samples_go_one_request_each_with_seed_plus_i(monkeypatch: pytest.MonkeyPatch) -> None:
    seeded = SamplingParams(max_tokens=3, temperature=1.0, seed=40, stop_strings=(), stop_token_ids=())
    bodies = await _sent(monkeypatch, seeded, 3, LogprobSpec())
    assert sorted(b["sampling_params"]["sampling_seed"] for b in bodies) == [40, 41, 42]
    assert all("n" not in b["sampling_params"] for b in bodies)


async def test_prompt_logprobs_ride_with_sample_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = await _sent(monkeypatch, PARAMS, 4, LogprobSpec(prompt=True))
    first = next(b for b in bodies if "logprob_start_len" in b)
    rest = next(b for b in bodies if b is not first)
    assert first["sampling_params"].get("n", 1) == 1 and rest["sampling_params"]["n"] == 3
    assert "logprob_start_len" not in rest


async def test_n_samples_on_the_cpu_engine_differ_and_carry_their_logprobs(client) -> None:  # noqa: F811
    hot = SamplingParams(max_tokens=6, temperature=2.0, stop_strings=(), stop_token_ids=())
    out = await sample_on_engine(client, PROMPT, hot, num_samples=4, logprobs=LogprobSpec())
    assert len(out.sequences) == 4
    assert all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in out.sequences)
    assert len({tuple(s.tokens) for s in out.sequences}) > 1  # four draws, not one answer four times
