"""Start the gateway on a free loopback port over the local runtime (`python -m miles.driver.local_server`)
or the production Ray runtime (`ray_gateway_server.py`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles.contract.ports import claim_port

BASE_MODEL = "Qwen/Qwen3-8B"  # the name tests map to the tiny model


@dataclass
class GatewayProcess:
    url: str
    workdir: Path
    proc: subprocess.Popen[bytes]
    runtime: str = "local"  # or "ray": which runtime the gateway serves

    @property
    def request_log(self) -> Path:
        return self.workdir / "requests.jsonl"

    def requests(self) -> list[dict]:
        if not self.request_log.exists():
            return []
        return [json.loads(line) for line in self.request_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_gateway(
    model_dir: Path, workdir: Path, api_keys: dict[str, str], *extra: str, timeout_s: float = 180.0
) -> GatewayProcess:
    """`api_keys`: key -> tenant. `extra`: more `python -m miles.driver.local_server` flags."""
    workdir.mkdir(parents=True, exist_ok=True)
    keys = workdir / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for key, tenant in api_keys.items()))
    port = claim_port("GATEWAY_PORT")  # bound seconds from now, after the runtime's start
    cmd = [
        sys.executable, "-m", "miles.driver.local_server",
        "--model-path", str(model_dir),
        "--model-name", BASE_MODEL,
        "--port", str(port),
        "--api-keys-file", str(keys),
        "--checkpoint-root", str(workdir / "checkpoints"),
        "--request-log", str(workdir / "requests.jsonl"),
        "--engine-log", str(workdir / "engine.log"),
        *extra,
    ]  # fmt: skip
    return _spawn(cmd, workdir, port, timeout_s)


def start_ray_gateway(
    model_dir: Path, workdir: Path, api_keys: dict[str, str], *extra: str, timeout_s: float = 300.0
) -> GatewayProcess:
    """The same gateway over the production Ray runtime (ray_gateway_server.py: the driver's bring-up
    on a local Ray). `extra`: --long-poll-s / --fwdbwd-max-chunk-len."""
    workdir.mkdir(parents=True, exist_ok=True)
    keys = workdir / "keys.txt"
    keys.write_text("".join(f"{key} {tenant}\n" for key, tenant in api_keys.items()))
    port = claim_port("GATEWAY_PORT")  # bound seconds from now, after the runtime's start
    cmd = [
        sys.executable, str(Path(__file__).with_name("ray_gateway_server.py")),
        "--model-path", str(model_dir),
        "--model-name", BASE_MODEL,
        "--workdir", str(workdir),
        "--port", str(port),
        "--api-keys-file", str(keys),
        *extra,
    ]  # fmt: skip
    gateway = _spawn(cmd, workdir, port, timeout_s)
    gateway.runtime = "ray"
    return gateway


def _spawn(cmd: list[str], workdir: Path, port: int, timeout_s: float) -> GatewayProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(workdir / "gateway.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited early:\n{(workdir / 'gateway.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return GatewayProcess(url, workdir, proc)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError(
        f"gateway not healthy after {timeout_s} s:\n{(workdir / 'gateway.log').read_text()[-3000:]}"
    )
