"""EngineProcess: the one way an engine process (SGLang or the CPU engine) is started and stopped.

Built from an `EngineConfig` (which alone builds the argv), it starts the engine with `engine_env()`
(keep-alive above the client's expiry), the config's per-job API key, its own process group and the
parent-death signal: whoever holds it (the Ray engine actor, the local runtime) cannot leave an orphan
engine behind, and a normal stop terminates the engine's whole process group. When the engine exits
without being asked to, `on_exit(returncode)` runs on a watcher thread (the Ray actor ends itself there).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from miles.contract.ports import claim_port
from miles.engines.config import EngineConfig
from miles.engines.env import engine_env
from miles.engines.sglang_client import SGLangApiClient

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
HEALTH_POLL_S = 0.2

ExitHook = Callable[[int], None]


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the process that started it goes away."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EngineProcess:
    """One engine on a free port of `host`; `visible_gpus` become its CUDA_VISIBLE_DEVICES (TP > 1)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        host: str = "127.0.0.1",
        visible_gpus: Sequence[int] = (),
        on_exit: ExitHook | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self._visible_gpus = tuple(visible_gpus)
        self._on_exit = on_exit
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self.url: str | None = None

    def environment(self) -> dict[str, str]:
        """engine_env() + thread count + the engine's GPUs; the engine config's own env wins."""
        threads = str(self.config.threads)
        extra = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if self._visible_gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self._visible_gpus)
        return engine_env(extra={**extra, **self.config.env})

    def start(self, log_path: str | None = None) -> str:
        """Launch the engine; returns its base URL (not yet healthy: see `wait_healthy`).

        `log_path`: append the engine's output there instead of this process's stdout."""
        if self._proc is not None:
            raise RuntimeError("this EngineProcess already started its engine; make a new one to restart")
        port = claim_port("ENGINE_PORT")  # free on every address of this node, held while we live
        argv = self.config.command(self.host, port)
        logger.info(
            "starting engine: %s", [a if not a.startswith("--api-key") else "--api-key=***" for a in argv]
        )
        output = open(log_path, "ab") if log_path else None  # noqa: SIM115 (the child keeps it open)
        try:
            self._proc = subprocess.Popen(
                argv,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
            )
        finally:
            if output is not None:
                output.close()
        threading.Thread(target=self._watch, name=f"engine-watcher-{port}", daemon=True).start()
        self.url = f"http://{self.host}:{port}"
        return self.url

    def _watch(self) -> None:
        assert self._proc is not None
        code = self._proc.wait()
        if self._stopping:
            return
        logger.error("engine process %d exited with %s", self._proc.pid, code)
        if self._on_exit is not None:
            self._on_exit(code)

    def client(self) -> SGLangApiClient:
        """A client of this engine, with its key and weight API."""
        if self.url is None:
            raise RuntimeError("the engine is not started")
        return SGLangApiClient(self.url, api_key=self.config.api_key, weight_api=self.config.weight_api)

    async def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Until /health answers 200; fails at once if the engine exits while loading."""
        limit = self.config.startup_timeout_s if timeout_s is None else timeout_s
        client = self.client()
        deadline = time.monotonic() + limit
        while True:
            if not self.alive():
                raise RuntimeError(
                    f"the engine at {self.url} exited with code {self.returncode()} while starting"
                )
            with contextlib.suppress(Exception):
                if await client.health(timeout_s=5.0):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine at {self.url} was not healthy after {limit:.0f} s")
            await asyncio.sleep(HEALTH_POLL_S)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def stop(self) -> int | None:
        """Terminate the engine's process group (SIGTERM, then SIGKILL after a grace period)."""
        self._stopping = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
