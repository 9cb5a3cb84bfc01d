"""Suite-wide settings: offline Hugging Face, Ray without auth, no telemetry; the tiny model fixture."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-shaped model directory (config, tokenizer, seeded safetensors), built once."""
    from miles.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: MILES_TEST_REDIS_URL (.ci/run starts one), else a private redis-server for this
    session, else the test skips with the reason."""
    url = os.environ.get("MILES_TEST_REDIS_URL")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("no MILES_TEST_REDIS_URL and no redis-server binary (apt-get install redis-server)")
    from miles.state.local_redis import local_redis_server

    with local_redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
