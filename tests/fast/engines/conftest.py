"""Fixtures of the engine tests: an in-process CPU engine on loopback and a local reference model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.engines.cpu.server import create_app
from miles.utils.serving import ServerThread


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"engine at {url} not healthy within {timeout_s} s")


@pytest.fixture(scope="module")
def cpu_engine(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """The CPU engine app on uvicorn in a thread (current weight API); `.app.state.engine` is its core."""
    app = create_app(str(tiny_model_dir), served_model_name="tiny")
    with ServerThread(app) as srv:
        srv.app = app  # type: ignore[attr-defined]
        wait_healthy(srv.url)
        yield srv


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _sequence_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


@pytest.fixture(scope="session")
def sequence_logprobs():
    """`fn(model, prompt, output)`: log p(output[i] | prompt + output[:i]) from one full forward."""
    return _sequence_logprobs
