"""The local runtime starts its CPU engine the way jobs do: keep-alive env, a per-process key."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.engines.errors import EngineUnauthorized
from miles.engines.sglang_client import SGLangApiClient
from miles.runtime.local import LocalRuntime
from miles.seam.runtime import SamplerTarget
from miles.types import LogprobSpec, SamplingParams
from miles.utils.http import close_clients


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def test_local_runtime_engine_needs_its_key_and_has_the_keepalive_env(
    tiny_model_dir: Path, monkeypatch
) -> None:
    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE", raising=False)
    runtime = await LocalRuntime.start(tiny_model_dir, model_name="tiny")
    try:
        engine = runtime.engine
        assert engine.config.api_key  # a fresh key per runtime
        assert _environ_of(engine.pid())["SGLANG_TIMEOUT_KEEP_ALIVE"] == "600"  # type: ignore[arg-type]
        with pytest.raises(EngineUnauthorized):
            await SGLangApiClient(engine.url).model_info()  # type: ignore[arg-type]
        # the runtime's own client carries the key: sampling works
        out = await runtime.sample(
            SamplerTarget("tiny"), [1, 2, 3], SamplingParams(max_tokens=2), 1, LogprobSpec()
        )
        assert len(out.sequences) == 1 and len(out.sequences[0].tokens) == 2
        seeded = SamplingParams(max_tokens=3, seed=4, stop_strings=(), stop_token_ids=())
        whole = await runtime.sample(SamplerTarget("tiny"), [1, 2, 3], seeded, 2, LogprobSpec())
        streamed: dict[int, list[int]] = {0: [], 1: []}
        async for chunk in runtime.stream_sample(SamplerTarget("tiny"), [1, 2, 3], seeded, 2):
            streamed[chunk.index] += chunk.tokens
        assert [streamed[0], streamed[1]] == [s.tokens for s in whole.sequences]
    finally:
        await runtime.close()
        await close_clients()
    assert not runtime.engine.alive()
