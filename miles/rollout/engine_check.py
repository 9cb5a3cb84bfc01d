"""The engine half of `launcher selftest`: every control call the runtime makes, in the runtime's order,
against each real engine of the job, timed. The weight push and adapter loads are checked through the
gateway afterwards (the runtime's own code paths); this covers the calls around them.

It runs inside one weight-update bracket (health checks paused, the update lock held, no engine marked
ready or pending by it), so nothing else of the runtime talks to the engines meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles.engines.sglang_client import SGLangApiClient
from miles.errors import MilesError
from miles.rollout.controller import InferenceController

PROBE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
PROBE_TOKENS = 4


class EngineCheckFailed(MilesError):
    """An engine refused or mis-answered a call; the message names the engine, the call and the answer."""

    def __init__(self, message: str, *, engine: str, url: str) -> None:
        super().__init__(message)
        self.engine = engine
        self.url = url


@dataclass
class EngineCalls:
    """One engine's calls in order: (call, milliseconds)."""

    engine: str
    url: str
    calls: list[tuple[str, float]] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.engine}: " + ", ".join(f"{name} {ms:.0f} ms" for name, ms in self.calls)


def check_generate_answer(answer: Any) -> str | None:
    """What is wrong with a /generate answer asked for logprobs (None when nothing is)."""
    if not isinstance(answer, dict):
        return f"expected one JSON object, got {type(answer).__name__}"
    tokens = answer.get("output_ids")
    meta = answer.get("meta_info") or {}
    logprobs = meta.get("output_token_logprobs")
    if not isinstance(tokens, list) or not tokens:
        return f"no output_ids in {sorted(answer)}"
    if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
        got = "none" if logprobs is None else len(logprobs)
        return f"meta_info.output_token_logprobs has {got} entries for {len(tokens)} output tokens"
    if not all(isinstance(entry, list | tuple) and entry and entry[0] <= 0.0 for entry in logprobs):
        return f"output_token_logprobs entries are not [logprob <= 0, token_id, ...]: {logprobs[:2]}"
    return None


async def _timed(calls: EngineCalls, name: str, work: Callable[[], Awaitable[Any]]) -> Any:
    started = time.perf_counter()
    try:
        result = await work()
    except Exception as exc:
        raise EngineCheckFailed(
            f"{calls.engine} ({calls.url}): {name} failed: {type(exc).__name__}: {exc}",
            engine=calls.engine,
            url=calls.url,
        ) from exc
    calls.calls.append((name, (time.perf_counter() - started) * 1e3))
    return result


async def check_engine(client: SGLangApiClient, name: str, version: str, pause_mode: str) -> EngineCalls:
    calls = EngineCalls(name, client.base_url)

    async def healthy() -> None:
        if not await client.health():
            raise RuntimeError("GET /health did not answer 200")

    async def generate() -> None:
        answer = await client.generate(
            input_ids=PROBE_PROMPT,
            sampling_params={"max_new_tokens": PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True},
            return_logprob=True,
        )
        problem = check_generate_answer(answer)
        if problem:
            raise RuntimeError(f"/generate with logprobs: {problem}")

    await _timed(calls, "health", healthy)
    await _timed(calls, "model_info", client.model_info)
    await _timed(calls, "generate+logprobs", generate)
    await _timed(calls, f"pause({pause_mode})", lambda: client.pause_generation(pause_mode))  # type: ignore[arg-type]
    await _timed(calls, "flush_cache", client.flush_cache)
    await _timed(calls, "update_weight_version", lambda: client.update_weight_version(version, False))
    await _timed(calls, "continue", client.continue_generation)
    return calls


async def check_engines(inference: InferenceController, pause_mode: str) -> list[EngineCalls]:
    """Every serving engine, one after another (a failure names the first engine that failed)."""
    async with inference.weight_update(base_weights=False) as update:
        version = str(update.version)
        return [await check_engine(cell.client, cell.name, version, pause_mode) for cell in update.engines]


async def cycle_adapters(inference: InferenceController) -> list[EngineCalls]:
    """LoRA: unload every published adapter from every engine and load it again (what an eviction and a
    respawned engine do), timed per engine; the adapters are loaded again afterwards, so sampling goes on."""
    async with inference.weight_update(base_weights=False) as update:
        adapters = sorted(inference.published_adapters.items())
        return [await _cycle_on(cell.client, cell.name, adapters) for cell in update.engines]


async def _cycle_on(client: SGLangApiClient, name: str, adapters: list[tuple[str, str]]) -> EngineCalls:
    calls = EngineCalls(name, client.base_url)
    for adapter, path in adapters:
        await _timed(calls, "unload_lora_adapter", lambda a=adapter: client.unload_lora_adapter(a))
        await _timed(calls, "load_lora_adapter", lambda a=adapter, p=path: client.load_lora_adapter(a, p))
    return calls
