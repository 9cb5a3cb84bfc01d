"""Store fixtures: every test in this folder runs against the memory store and a real Redis.

Redis comes from MILES_TEST_REDIS_URL when set (.ci/run starts one), else a private redis-server on a free
port for this session, else the Redis cases skip with the reason.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from miles.state import MemoryStateStore, StateStore


class FakeClock:
    """A settable monotonic clock for TTL tests on the memory store."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_ping(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout_s} s")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: the CI one, or a private server for this test session."""
    url = os.environ.get("MILES_TEST_REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no MILES_TEST_REDIS_URL and no redis-server binary (apt-get install redis-server)")
    workdir: Path = tmp_path_factory.mktemp("redis")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_ping(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def redis_key_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def advance(store: StateStore, clock: FakeClock) -> Callable[[float], Awaitable[None]]:
    """Let `seconds` pass for the store: the memory store's clock jumps, Redis really waits."""

    async def _advance(seconds: float) -> None:
        if isinstance(store, MemoryStateStore):
            clock.now += seconds
        else:
            await asyncio.sleep(seconds)

    return _advance


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[StateStore]:
    """One store per test; Redis stores get a unique key prefix and are purged afterwards."""
    if request.param == "memory":
        mem = MemoryStateStore(clock=clock)
        yield mem
        await mem.close()
        return
    from miles.state.redis_store import RedisStateStore

    url = request.getfixturevalue("redis_url")
    red = RedisStateStore(url, key_prefix=request.getfixturevalue("redis_key_prefix"))
    try:
        yield red
    finally:
        await red.purge()
        await red.close()
