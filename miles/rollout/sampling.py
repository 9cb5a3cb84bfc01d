"""Sampling on one engine: Tinker's sampling parameters in SGLang's vocabulary, and its answers back.

Shared by every runtime (the local one and the Ray one), so the mapping of stop conditions, seeds and
logprobs exists once. Logprobs are the SAMPLED tokens' (`output_token_logprobs`), never the top-1's.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from typing import Any

from miles.engines.sglang_client import SGLangApiClient
from miles.types import SampledSequence, SampleOutput, SamplingParams

DEFAULT_MAX_TOKENS = 256


def snapshot_adapter_name(snapshot: str) -> str:
    """The engine-side LoRA name of one immutable sampler snapshot (its resolved directory)."""
    return "snap-" + hashlib.sha256(snapshot.encode()).hexdigest()[:16]


def engine_sampling_params(params: SamplingParams, *, seed: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "no_stop_trim": True,  # the sampled tokens are the answer; never cut them
    }
    if params.stop_strings == () and params.stop_token_ids == ():
        out["ignore_eos"] = True  # stop=[]: run to max_tokens
    if params.stop_strings:
        out["stop"] = list(params.stop_strings)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        out["sampling_seed"] = seed
    return out


def sequence_from_answer(answer: dict[str, Any]) -> SampledSequence:
    meta = answer.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"the engine aborted the request: {finish.get('message')}")
    tokens = [int(t) for t in answer.get("output_ids", [])]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"engine returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    stop_reason = "length" if finish.get("type") == "length" else "stop"
    return SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason=stop_reason)


def prompt_logprobs_from_answer(answer: dict[str, Any], prompt_len: int) -> list[float | None]:
    entries = answer.get("meta_info", {}).get("input_token_logprobs") or []
    values: list[float | None] = [None if e[0] is None else float(e[0]) for e in entries][:prompt_len]
    if len(values) != prompt_len:
        raise RuntimeError(f"engine returned {len(values)} prompt logprobs for a {prompt_len}-token prompt")
    values[0] = None
    return [None if v is None or math.isnan(v) else v for v in values]


async def sample_on_engine(
    client: SGLangApiClient,
    prompt: list[int],
    params: SamplingParams,
    *,
    num_samples: int,
    prompt_logprobs: bool,
    lora_path: str | None = None,
) -> SampleOutput:
    """`num_samples` generations (seed + i each, so seeded samples differ but repeat exactly)."""

    async def one(i: int) -> dict[str, Any]:
        seed = None if params.seed is None else params.seed + i
        return await client.generate(
            input_ids=prompt,
            sampling_params=engine_sampling_params(params, seed=seed),
            return_logprob=True,
            lora_path=lora_path,
            logprob_start_len=0 if prompt_logprobs and i == 0 else None,
        )

    answers = await asyncio.gather(*(one(i) for i in range(num_samples)))
    return SampleOutput(
        sequences=[sequence_from_answer(a) for a in answers],
        prompt_logprobs=prompt_logprobs_from_answer(answers[0], len(prompt)) if prompt_logprobs else None,
    )
