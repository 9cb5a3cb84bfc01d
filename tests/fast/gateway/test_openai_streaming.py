"""OpenAI streaming is real streaming: the real `openai` client receives a chunk while the runtime is still
producing the sample (the double holds its second token until the test has seen the first), chunks
concatenate to the whole text, and a stream holds one of the sampling slots until it ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import openai
import pytest
from runtime_double import BASE, DoubleRuntime, double_app
from transformers import AutoTokenizer

from miles.seam.runtime import SamplerTarget
from miles.types import SampleChunk, SamplingParams
from miles.utils.serving import ServerThread

KEY = "tml-stream-key-0001"


class HeldRuntime(DoubleRuntime):
    """The double whose streams stop after their first token until `release` is set (from any thread)."""

    def __init__(self, tokenizer_path: str) -> None:
        super().__init__(tokenizer_path=tokenizer_path)
        self.release = threading.Event()
        self.open_streams = 0
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.words = self.tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta iota kappa")

    def sample_tokens(self, prompt: list[int], index: int, n: int) -> list[int]:
        """Tokens of real words (the double's arithmetic ids decode to partial characters)."""
        return self.words[index : index + n]

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        self.open_streams += 1
        try:
            async for chunk in super().stream_sample(target, prompt, params, num_samples):
                yield chunk
                if not self.release.is_set():
                    self.stream_events.append(("held", chunk.index, len(chunk.tokens)))
                    await asyncio.to_thread(self.release.wait, 30)
        finally:
            self.open_streams -= 1


@pytest.fixture
def served(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[openai.OpenAI, HeldRuntime]]:
    runtime = HeldRuntime(str(tiny_model_dir))
    app = double_app(tmp_path, runtime, {KEY: "alpha"}, long_poll_s=0.2, max_concurrent_samples=1)
    with ServerThread(app) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30), runtime
    runtime.release.set()


def test_the_first_chunk_arrives_while_the_sample_is_still_running(served) -> None:
    client, runtime = served
    stream = client.completions.create(model=BASE, prompt="one two", max_tokens=5, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    # the runtime holds everything after its first token until released: only that token exists yet
    assert [e for e in runtime.stream_events if e[0] != "held"] == [("chunk", 0, 0)]
    assert first.choices[0].finish_reason is None
    runtime.release.set()
    rest = list(chunks)
    assert runtime.stream_events[-1] == ("end", -1, 5)
    assert rest[-1].choices[0].finish_reason == "length"
    # the pieces are the whole sample's text
    text = "".join(c.choices[0].text for c in [first, *rest])
    assert text == runtime.tokenizer.decode(runtime.words[:5], skip_special_tokens=True)


def test_a_stream_holds_a_sampling_slot_until_it_ends(served) -> None:
    """max_concurrent_samples=1: a second request waits while a stream is open."""
    client, runtime = served
    stream = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    result: dict[str, object] = {}

    def second() -> None:
        result["reply"] = client.completions.create(model=BASE, prompt="x", max_tokens=2)

    waiter = threading.Thread(target=second)
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive() and runtime.calls.count(("sample", BASE)) == 0  # blocked behind the open stream
    runtime.release.set()
    list(chunks)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and runtime.calls.count(("sample", BASE)) == 1
