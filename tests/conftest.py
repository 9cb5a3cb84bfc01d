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


SYSTEM_TESTS = "tests/system/"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The system tests first: under `make test` they are the longest lane (below), so it starts at once."""
    items.sort(key=lambda item: not item.nodeid.startswith(SYSTEM_TESTS))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Lanes for `make test` (pytest-xdist): the system tests are one unit of work, run in order on one
    worker (they share the Slurm and OpenPBS clusters, whose nodes one job at a time fills), and every
    other module is a unit of its own (its module fixtures, Ray clusters and stacks, start once), handed
    to whichever worker is free, in collection order: the system unit first."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "system" if module.startswith(SYSTEM_TESTS) else module

    config.option.loadscopereorder = False  # keep the collection order: the system unit first
    return Lanes(config, log)
