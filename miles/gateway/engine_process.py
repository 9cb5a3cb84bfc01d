"""Start and stop one CPU engine subprocess (`python -m miles.engines.cpu`) on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.engines.sglang_client import SGLangApiClient
from miles.utils.serving import free_port


class EngineProcess:
    def __init__(self, model_path: Path, *, log_path: Path | None = None, threads: int = 1) -> None:
        self.model_path = Path(model_path).resolve()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._threads = threads
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(self._threads), "MKL_NUM_THREADS": str(self._threads)}
        cmd = [sys.executable, "-m", "miles.engines.cpu", "--model-path", str(self.model_path)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--threads", str(self._threads)]
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        client = SGLangApiClient(self.url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"CPU engine exited with code {self._proc.returncode} before it was ready")
            with contextlib.suppress(Exception):
                if await client.health(timeout_s=2.0):
                    return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"CPU engine at {self.url} not healthy after {timeout_s:.0f} s")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
