"""Sampling on one engine: Tinker's sampling parameters in SGLang's vocabulary, and its answers back.

Shared by every runtime (the local one and the Ray one), so the mapping of stop conditions, seeds and
logprobs exists once. Logprobs are the SAMPLED tokens' (`output_token_logprobs`), never the top-1's.

Tinker's extra logprob fields map onto SGLang's own request fields (see docs/engines.md):
- prompt logprobs, `topk_prompt_logprobs`, `prompt_logprobs_last_n` and `target_prompt_logprobs` ride on
  the first sample's request: `logprob_start_len` (where scoring starts), `top_logprobs_num` (one width for
  prompt and output, so the larger of the two asked for, cut back per side) and `token_ids_logprob` (one id
  list scored at every position: the distinct ids of the target matrix);
- `topk_sample_logprobs` is `top_logprobs_num` on every sample's request;
- `prompt_alt_tokens_k` has no SGLang field: it is one batched request of one-token generations, k per
  prompt prefix, at the request's temperature (the prefixes share SGLang's prefix cache).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np

from miles.engines.sglang_client import SGLangApiClient
from miles.errors import UnavailableError
from miles.types import (
    LogprobSpec,
    SampleChunk,
    SampledSequence,
    SampleOutput,
    SamplingParams,
    TimedPart,
    TopLogprobs,
)

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


class SampleAbortedError(UnavailableError):
    """The engine aborted a sample before it finished. A weight push does this to every sample running on
    an engine (update_weight_version with abort_all_requests), so that no sample mixes two versions of
    the weights; the sample produced nothing the caller saw, so sending it again is safe."""


def _finish_type(answer: dict[str, Any]) -> str | None:
    finish = answer.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise SampleAbortedError(
            f"the engine aborted this sample before it finished ({finish.get('message')}): a weight update "
            "aborts the samples running on an engine, so that no sample mixes two versions of the weights; "
            "send it again"
        )
    return finish.get("type")


def _ranked(row: list[list[Any]] | None, k: int) -> TopLogprobs | None:
    """SGLang's [[logprob, token id, text], ...] row as Tinker's [(token id, logprob), ...], at most k."""
    if not row:
        return None
    return [(int(entry[1]), float(entry[0])) for entry in row[:k]]


def sequence_from_answer(answer: dict[str, Any], topk: int = 0) -> SampledSequence:
    meta = answer.get("meta_info", {})
    finish = _finish_type(answer)
    tokens = [int(t) for t in answer.get("output_ids", [])]
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"engine returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    top = None
    if topk > 0:
        rows = meta.get("output_top_logprobs") or []
        if len(rows) != len(tokens):
            raise RuntimeError(f"engine returned {len(tokens)} tokens but {len(rows)} top-logprob rows")
        top = [_ranked(row, topk) for row in rows]
    stop_reason = "length" if finish == "length" else "stop"
    versions = meta.get("weight_versions")
    spans = versions if isinstance(versions, list) else None
    return SampledSequence(tokens, logprobs, stop_reason, top, spans)


# ----- the prompt side -------------------------------------------------------------------------------------


def first_scored_position(prompt_len: int, spec: LogprobSpec) -> int:
    """The first prompt position whose logprob (and top-k) is reported; position 0 has no context."""
    return 1 if spec.prompt_last_n is None else prompt_len - spec.prompt_last_n


def logprob_start_len(prompt_len: int, spec: LogprobSpec) -> int | None:
    """SGLang's `logprob_start_len` for what `spec` asks of the prompt, or None (output only).

    SGLang's entry at the start position itself is always None (it shifts its prefill rows by one), so
    scoring position p needs a start of at most p - 1.
    """
    starts: list[int] = []
    if spec.prompt or spec.topk_prompt > 0:
        starts.append(first_scored_position(prompt_len, spec) - 1)
    if spec.target_prompt is not None:
        named_rows = np.flatnonzero((spec.target_prompt >= 0).any(axis=1))
        if named_rows.size:
            starts.append(int(named_rows[0]))  # row r scores position r + 1
    return min(starts) if starts else None


def target_ids(spec: LogprobSpec) -> list[int] | None:
    """SGLang's `token_ids_logprob`: the distinct ids the target matrix names."""
    if spec.target_prompt is None:
        return None
    ids = np.unique(spec.target_prompt[spec.target_prompt >= 0])
    return [int(t) for t in ids] or None


def _by_position(entries: list[Any], start: int, prompt_len: int, name: str) -> list[Any]:
    """Answer rows (one per position from `start`) placed at their prompt positions."""
    if len(entries) < prompt_len - start:
        raise RuntimeError(
            f"engine returned {len(entries)} {name} rows for positions {start}..{prompt_len - 1}"
        )
    rows: list[Any] = [None] * prompt_len
    rows[start:] = entries[: prompt_len - start]
    return rows


def prompt_logprobs_from_answer(
    answer: dict[str, Any], prompt_len: int, spec: LogprobSpec, start: int
) -> list[float | None]:
    entries = answer.get("meta_info", {}).get("input_token_logprobs") or []
    rows = _by_position(entries, start, prompt_len, "input_token_logprobs")
    first = first_scored_position(prompt_len, spec)
    values: list[float | None] = []
    for position, entry in enumerate(rows):
        value = None if position < first or entry is None or entry[0] is None else float(entry[0])
        values.append(None if value is None or math.isnan(value) else value)
    return values


def topk_prompt_from_answer(
    answer: dict[str, Any], prompt_len: int, spec: LogprobSpec, start: int
) -> list[TopLogprobs | None]:
    entries = answer.get("meta_info", {}).get("input_top_logprobs") or []
    rows = _by_position(entries, start, prompt_len, "input_top_logprobs")
    first = first_scored_position(prompt_len, spec)
    return [None if p < first else _ranked(row, spec.topk_prompt) for p, row in enumerate(rows)]


def target_prompt_from_answer(
    answer: dict[str, Any], prompt_len: int, spec: LogprobSpec, start: int
) -> np.ndarray:
    """float32 of the target's shape: the logprob of each named id at its position, 0.0 for -1 cells."""
    assert spec.target_prompt is not None
    entries = answer.get("meta_info", {}).get("input_token_ids_logprobs") or []
    rows = _by_position(entries, start, prompt_len, "input_token_ids_logprobs")
    out = np.zeros(spec.target_prompt.shape, dtype=np.float32)
    for r, c in zip(*np.nonzero(spec.target_prompt >= 0), strict=True):
        scored = {int(e[1]): float(e[0]) for e in rows[r + 1] or []}
        token = int(spec.target_prompt[r, c])
        if token not in scored:
            raise RuntimeError(f"engine returned no logprob for token {token} at prompt position {r + 1}")
        out[r, c] = scored[token]
    return out


async def alt_tokens_on_engine(
    client: SGLangApiClient,
    prompt: list[int],
    params: SamplingParams,
    k: int,
    *,
    seed_base: int | None,
    lora_path: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """k independent draws at the request's temperature from the next-token distribution after every
    prompt prefix prompt[:p], p = 1..len-1: (int64 ids, float32 logprobs), both [len(prompt) - 1, k]."""
    rows = len(prompt) - 1
    tokens = np.zeros((rows, k), dtype=np.int64)
    logprobs = np.zeros((rows, k), dtype=np.float32)
    if rows == 0 or k == 0:
        return tokens, logprobs
    draws = [(p, j) for p in range(1, len(prompt)) for j in range(k)]
    one_token = {"max_new_tokens": 1, "temperature": params.temperature, "top_p": 1.0, "top_k": -1}
    one_token |= {"ignore_eos": True, "no_stop_trim": True}
    sampling = [
        one_token if seed_base is None else {**one_token, "sampling_seed": seed_base + i}
        for i in range(len(draws))
    ]
    answers = await client.generate(
        input_ids=[prompt[:p] for p, _ in draws],
        sampling_params=sampling,
        return_logprob=True,
        lora_path=lora_path,
    )
    for (p, j), answer in zip(draws, answers, strict=True):
        seq = sequence_from_answer(answer)
        if len(seq.tokens) != 1:
            raise RuntimeError(f"engine returned {len(seq.tokens)} tokens for a one-token draw")
        tokens[p - 1, j], logprobs[p - 1, j] = seq.tokens[0], seq.logprobs[0]
    return tokens, logprobs


# ----- sampling --------------------------------------------------------------------------------------------


async def sample_on_engine(
    client: SGLangApiClient,
    prompt: list[int],
    params: SamplingParams,
    *,
    num_samples: int,
    logprobs: LogprobSpec,
    lora_path: str | None = None,
) -> SampleOutput:
    """`num_samples` generations (seed + i each, so seeded samples differ but repeat exactly)."""
    start = logprob_start_len(len(prompt), logprobs) if logprobs.prompt_side() else None
    prompt_top = logprobs.topk_prompt if start is not None else 0

    async def one(i: int) -> dict[str, Any]:
        seed = None if params.seed is None else params.seed + i
        first = i == 0
        return await client.generate(
            input_ids=prompt,
            sampling_params=engine_sampling_params(params, seed=seed),
            return_logprob=True,
            lora_path=lora_path,
            logprob_start_len=start if first else None,
            top_logprobs_num=max(prompt_top, logprobs.topk_sample) if first else logprobs.topk_sample,
            token_ids_logprob=target_ids(logprobs) if first else None,
        )

    async def together(count: int) -> list[dict[str, Any]]:
        """`count` unseeded samples in one request (SGLang's `n`): the engine admits them at once and
        prefills the prompt once, instead of `count` requests that join the batch as they arrive."""
        answer = await client.generate(
            input_ids=prompt,
            sampling_params={**engine_sampling_params(params, seed=None), "n": count},
            return_logprob=True,
            lora_path=lora_path,
            top_logprobs_num=logprobs.topk_sample,
        )
        return answer if isinstance(answer, list) else [answer]

    async def all_samples() -> list[dict[str, Any]]:
        if params.seed is not None or num_samples == 1:  # seed + i each: one request per sample
            return list(await asyncio.gather(*(one(i) for i in range(num_samples))))
        if start is None:
            return await together(num_samples)
        # the prompt-side logprobs come with sample 0 only
        first, rest = await asyncio.gather(one(0), together(num_samples - 1))
        return [first, *rest]

    alt = None
    if logprobs.alt_tokens_k > 0:
        seed_base = None if params.seed is None else params.seed + num_samples
        alt = alt_tokens_on_engine(
            client, prompt, params, logprobs.alt_tokens_k, seed_base=seed_base, lora_path=lora_path
        )
    answers, alt_result = await asyncio.gather(all_samples(), alt if alt is not None else _none())
    out = SampleOutput(sequences=[sequence_from_answer(a, logprobs.topk_sample) for a in answers])
    out.timeline = engine_timeline(answers, time.time(), engine=client.base_url)
    if start is not None:
        first_answer, n = answers[0], len(prompt)
        if logprobs.prompt:
            out.prompt_logprobs = prompt_logprobs_from_answer(first_answer, n, logprobs, start)
        if logprobs.topk_prompt > 0:
            out.topk_prompt = topk_prompt_from_answer(first_answer, n, logprobs, start)
        if logprobs.target_prompt is not None:
            out.target_prompt = target_prompt_from_answer(first_answer, n, logprobs, start)
    if alt_result is not None:
        out.alt_tokens, out.alt_logprobs = alt_result
    return out


async def _none() -> None:
    return None


def engine_timeline(answers: list[dict[str, Any]], answered_s: float, *, engine: str) -> list[TimedPart]:
    """The engine's own time for a sample (SGLang's meta_info `e2e_latency`, the longest of the answers),
    ending when the answers arrived, with its token counts; none when the engine did not report it."""
    metas = [a.get("meta_info") or {} for a in answers]
    latencies = [m["e2e_latency"] for m in metas if isinstance(m.get("e2e_latency"), int | float)]
    if not latencies:
        return []
    took = max(latencies)
    args = {
        "engine": engine,
        "samples": len(answers),
        "prompt_tokens": metas[0].get("prompt_tokens"),
        "cached_tokens": metas[0].get("cached_tokens"),
        "completion_tokens": sum(int(m.get("completion_tokens") or 0) for m in metas),
    }
    return [TimedPart("generate", "engine", answered_s - took, took, args)]


async def stream_on_engine(
    client: SGLangApiClient,
    prompt: list[int],
    params: SamplingParams,
    *,
    num_samples: int,
    lora_path: str | None = None,
) -> AsyncGenerator[SampleChunk, None]:
    """`num_samples` streamed generations (seeds as in sample_on_engine), merged: each engine chunk's new
    tokens as soon as it arrives. SGLang's stream chunks are cumulative, so each sequence's new tokens are
    the output_ids past what was already passed on; a sequence's last chunk carries its stop reason."""
    queue: asyncio.Queue[SampleChunk | BaseException | None] = asyncio.Queue()

    async def one(i: int) -> None:
        seed = None if params.seed is None else params.seed + i
        sent = 0
        try:
            async for answer in client.generate_stream(
                input_ids=prompt,
                sampling_params=engine_sampling_params(params, seed=seed),
                return_logprob=True,
                lora_path=lora_path,
            ):
                finish = _finish_type(answer)
                ids = answer.get("output_ids", [])
                lps = answer.get("meta_info", {}).get("output_token_logprobs", [])
                stop = None if finish is None else ("length" if finish == "length" else "stop")
                if len(ids) > sent or stop is not None:
                    new_lps = [float(e[0]) for e in lps[sent : len(ids)]]
                    await queue.put(SampleChunk(i, [int(t) for t in ids[sent:]], new_lps, stop))
                    sent = len(ids)
            await queue.put(None)
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(one(i)) for i in range(num_samples)]
    try:
        running = num_samples
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
