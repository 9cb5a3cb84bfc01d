"""A private redis-server on a loopback port: for tests and single-machine runs without a Redis.

No automatic persistence (`--save ''`, no AOF). `LocalRedisServer` can be stopped and started again on the
same port and directory (outage tests); `stop(save=True)` writes the data out first, and the next start
loads it, as a Redis restarted by its operator would.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resp(*words: str) -> bytes:
    """One command in Redis's wire protocol (RESP), for the raw socket calls below."""
    out = [f"*{len(words)}\r\n".encode()]
    for word in words:
        out.append(f"${len(word.encode())}\r\n{word}\r\n".encode())
    return b"".join(out)


def _wait_for_ping(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(_resp("PING"))
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout_s} s")


class LocalRedisServer:
    """redis-server on 127.0.0.1:`port` (a free one by default) with its files in `workdir`."""

    def __init__(self, workdir: Path, *, port: int | None = None, binary: str | None = None) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary = found
        self.workdir = workdir
        self.port = port or free_loopback_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> None:
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self._proc = subprocess.Popen(
            [*args, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_for_ping(self.port, self._proc, timeout_s)

    def stop(self, *, save: bool = False, timeout_s: float = 10.0) -> None:
        """End the server; `save`: write its data to `workdir` first (SHUTDOWN SAVE), for the next start."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        saved = save and self._shutdown_saving(timeout_s)
        if not saved:
            proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if save and (not saved or proc.returncode != 0):
            raise RuntimeError(f"redis-server on port {self.port} did not save its data before stopping")

    def _shutdown_saving(self, timeout_s: float) -> bool:
        """SHUTDOWN SAVE; False when the server did not take it (e.g. clients are paused)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as sock:
                sock.sendall(_resp("SHUTDOWN", "SAVE"))
                return sock.recv(64) == b""  # it closes the connection once saved; a reply is an error
        except OSError:
            return False


@contextmanager
def local_redis_server(workdir: Path, *, binary: str | None = None, timeout_s: float = 20.0) -> Iterator[str]:
    """Start redis-server in `workdir`, yield its `redis://127.0.0.1:PORT/0` URL, stop it afterwards."""
    server = LocalRedisServer(workdir, binary=binary)
    server.start(timeout_s)
    try:
        yield server.url
    finally:
        server.stop()
