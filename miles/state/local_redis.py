"""A private redis-server on a free loopback port: for tests and single-machine runs without a Redis.

No persistence (`--save ''`, no AOF): the server lives exactly as long as the context.
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


def _wait_for_ping(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout_s} s")


@contextmanager
def local_redis_server(workdir: Path, *, binary: str | None = None, timeout_s: float = 20.0) -> Iterator[str]:
    """Start redis-server in `workdir`, yield its `redis://127.0.0.1:PORT/0` URL, stop it afterwards."""
    binary = binary or shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_loopback_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*args, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_ping(port, proc, timeout_s)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
