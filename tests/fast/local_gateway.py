"""The driver's uvicorn gateway over a runtime, on loopback in a thread of the test process: what the tests
that drive the real tinker SDK against a LocalRuntime share."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from miles.checkpoints.manager import CheckpointManager
from miles.engines.config import EngineConfig
from miles.engines.process import EngineProcess
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.server import embedded_gateway_server
from miles.gateway.settings import GatewaySettings
from miles.seam.runtime import Runtime
from miles.state import MemoryStateStore
from miles.utils.serving import free_port


@contextmanager
def local_gateway(
    runtime: Runtime,
    checkpoint_dir: Path,
    key: str | dict[str, str],
    start_timeout_s: float = 30.0,
    settings: GatewaySettings | None = None,
) -> Iterator[str]:
    """Serve `runtime` for the one tenant holding `key`, or for each tenant of a {key: tenant} dict (memory
    store); yields the base URL. The server shuts down (its lifespan ends) when the context exits."""
    store = MemoryStateStore()
    keys = ApiKeys(key if isinstance(key, dict) else {key: "alpha"})
    checkpoints = CheckpointManager(checkpoint_dir, store)
    app = create_app(runtime, store, checkpoints, keys, settings or GatewaySettings())
    port = free_port()
    server = embedded_gateway_server(app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@contextmanager
def cpu_engine(model_dir: Path, log_path: Path) -> Iterator[EngineProcess]:
    """The CPU engine serving `model_dir` on loopback with its own API key, healthy, stopped on exit."""
    engine = EngineProcess(
        EngineConfig(model_path=str(model_dir), kind="cpu", api_key=secrets.token_hex(16)), host="127.0.0.1"
    )
    engine.start(str(log_path))
    try:
        asyncio.run(engine.wait_healthy(timeout_s=180.0))
        yield engine
    finally:
        engine.stop()
