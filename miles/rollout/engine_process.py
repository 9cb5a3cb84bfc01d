"""The Ray actor that owns one engine process, and shares its fate.

- the engine exits -> a watcher thread ends the actor process (`os._exit`), so Ray reports the actor dead;
- the actor dies (ray.kill, node loss, crash) -> the kernel kills the engine (PR_SET_PDEATHSIG), and a
  normal stop terminates the engine's whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence

import ray

from miles.engines.env import engine_env
from miles.rollout.config import EngineConfig
from miles.utils.serving import free_port

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the actor's process goes away."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EngineProcess:
    """Plain class (testable without Ray); `EngineProcessActor` is its Ray actor."""

    def __init__(
        self, config: EngineConfig, *, host: str | None = None, visible_gpus: Sequence[int] = ()
    ) -> None:
        self._config = config
        self._host = host or ray.util.get_node_ip_address()
        self._visible_gpus = tuple(visible_gpus)
        self._proc: subprocess.Popen | None = None
        self._stopping = False

    def start(self, log_path: str | None = None) -> str:
        """Launch the engine on a free port of this node; returns its base URL (not yet healthy).

        `log_path`: append the engine's output there (the job's logs/engine-<i>.log) instead of the
        actor's own stdout."""
        if self._proc is not None:
            raise RuntimeError("this engine process actor already started its engine")
        port = free_port(self._host)
        argv = self._config.command(self._host, port)
        env = self.environment()
        logger.info("starting engine: %s", argv)
        output = open(log_path, "ab") if log_path else None  # noqa: SIM115 (the child keeps it open)
        try:
            self._proc = subprocess.Popen(
                argv,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
            )
        finally:
            if output is not None:
                output.close()
        threading.Thread(target=self._exit_with_engine, name="engine-watcher", daemon=True).start()
        return f"http://{self._host}:{port}"

    def environment(self) -> dict[str, str]:
        """engine_env() + thread count + the engine's GPUs; the engine config's own env wins."""
        extra = {"OMP_NUM_THREADS": str(self._config.threads)}
        if self._visible_gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self._visible_gpus)
        return engine_env(extra={**extra, **self._config.env})

    def _exit_with_engine(self) -> None:
        assert self._proc is not None
        code = self._proc.wait()
        if not self._stopping:
            logger.error("engine process %d exited with %s; ending its actor", self._proc.pid, code)
            os._exit(1)

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

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


EngineProcessActor = ray.remote(max_restarts=0)(EngineProcess)
