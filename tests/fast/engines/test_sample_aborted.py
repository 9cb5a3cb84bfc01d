"""A sample running when a weight push updates the engine's version is aborted by the engine (so that no
sample mixes two versions of the weights). The caller gets an error of the family that says so and that
it can send the sample again (category unavailable: 503 on the OpenAI routes), not a bare RuntimeError
(which the gateway answers as a 500 "internal error"). Found by bench/soak.py's sampling traffic."""

from __future__ import annotations

import asyncio

from miles.engines.cpu.requests import Phase
from miles.errors import Category
from miles.rollout.sampling import SampleAbortedError, sample_on_engine
from miles.types import LogprobSpec, SamplingParams
from tests.fast.engines.test_cpu_engine_api import PROMPT, _wait_phase, client  # noqa: F401

LONG = SamplingParams(max_tokens=400, temperature=1.0, seed=3, stop_strings=(), stop_token_ids=())


async def test_a_sample_aborted_by_a_weight_version_update_is_a_retryable_error_saying_so(
    client,  # noqa: F811
    cpu_engine,
) -> None:
    sample = asyncio.create_task(
        sample_on_engine(client, PROMPT, LONG, num_samples=1, logprobs=LogprobSpec())
    )
    await _wait_phase(cpu_engine, Phase.RUNNING)
    await client.update_weight_version("v-soak")  # what a push does at its end (abort_all_requests)
    try:
        await asyncio.wait_for(sample, 30)
    except SampleAbortedError as exc:
        aborted = exc
    else:
        raise AssertionError("the sample finished although its engine aborted it")
    assert aborted.category is Category.UNAVAILABLE
    assert "aborted this sample" in str(aborted) and "send it again" in str(aborted)
    short = SamplingParams(max_tokens=3, temperature=1.0, seed=3, stop_strings=(), stop_token_ids=())
    again = await sample_on_engine(client, PROMPT, short, num_samples=1, logprobs=LogprobSpec())
    assert len(again.sequences[0].tokens) == 3  # sent again, it is served
