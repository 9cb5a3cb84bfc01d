"""EngineProcess: argv and environment (no process), then real CPU engine processes it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.contract.ports import CLAIMS_DIR_ENV, live_claims
from miles.engines.config import EngineConfig
from miles.engines.errors import EngineUnauthorized
from miles.engines.process import EngineProcess
from miles.engines.sglang_client import SGLangApiClient
from miles.utils.http import close_clients


def test_cpu_engine_argv_is_a_list_with_resolved_model_path(tmp_path: Path) -> None:
    odd = tmp_path / "model dir; rm -rf ~"
    odd.mkdir()
    config = EngineConfig(
        model_path=str(odd), weight_api="legacy", api_key="k", extra_args=("--served-model-name", "m")
    )
    argv = config.command("10.0.0.2", 31000)
    assert argv[:3] == [sys.executable, "-m", "miles.engines.cpu"]
    assert argv[argv.index("--model-path") + 1] == str(odd.resolve())  # one element, never shell text
    assert argv[argv.index("--port") + 1] == "31000" and "--legacy-weight-api" in argv
    assert argv[-3:] == ["--api-key=k", "--served-model-name", "m"]


def test_sglang_argv_has_tp_and_skips_warmup(tmp_path: Path) -> None:
    argv = EngineConfig(model_path=str(tmp_path), kind="sglang", gpus_per_engine=2).command("h", 1)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and "--skip-server-warmup" in argv


def test_bad_engine_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig(model_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kind"):
        EngineConfig(model_path=str(tmp_path), kind="vllm")  # type: ignore[arg-type]


def test_environment_keeps_operator_keepalive_and_sets_gpus(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE", raising=False)
    config = EngineConfig(model_path=str(tmp_path), threads=2)
    env = EngineProcess(config, host="127.0.0.1", visible_gpus=(2, 3)).environment()
    assert env["SGLANG_TIMEOUT_KEEP_ALIVE"] == "600"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "30")  # the operator's value wins
    assert EngineProcess(config, host="127.0.0.1").environment()["SGLANG_TIMEOUT_KEEP_ALIVE"] == "30"
    pinned = EngineConfig(model_path=str(tmp_path), env={"SGLANG_TIMEOUT_KEEP_ALIVE": "5"})
    assert EngineProcess(pinned, host="127.0.0.1").environment()["SGLANG_TIMEOUT_KEEP_ALIVE"] == "5"


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


async def test_engine_runs_with_keepalive_env_and_refuses_requests_without_its_key(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE", raising=False)
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(tmp_path / "claims"))
    exits: list[int] = []
    engine = EngineProcess(
        EngineConfig(model_path=str(tiny_model_dir), api_key="job-key"), on_exit=exits.append
    )
    engine.start()
    try:
        # its port was claimed (below the ephemeral range) before the engine bound it: no job on this node
        # picks it, and no outgoing connection takes it while the engine loads
        (claim,) = live_claims(tmp_path / "claims")
        assert (
            claim.owner_pid == os.getpid() and engine.url == f"http://127.0.0.1:{claim.ports['ENGINE_PORT']}"
        )
        await engine.wait_healthy(timeout_s=120)
        pid = engine.pid()
        assert pid is not None and _environ_of(pid)["SGLANG_TIMEOUT_KEEP_ALIVE"] == "600"
        with pytest.raises(EngineUnauthorized):
            await SGLangApiClient(engine.url).model_info()  # type: ignore[arg-type]
        assert "model_path" in await engine.client().model_info()
    finally:
        assert engine.stop() is not None
        await close_clients()
    time.sleep(0.2)
    assert exits == [] and not engine.alive()  # a requested stop is not an unexpected exit


def test_on_exit_runs_when_the_engine_dies_unasked(tiny_model_dir: Path) -> None:
    exited = threading.Event()
    codes: list[int] = []

    def on_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    engine = EngineProcess(EngineConfig(model_path=str(tiny_model_dir)), on_exit=on_exit)
    engine.start()
    try:
        os.kill(engine.pid(), signal.SIGKILL)  # type: ignore[arg-type]
        assert exited.wait(30), "on_exit was not called"
        assert codes == [-signal.SIGKILL]
    finally:
        engine.stop()


_PARENT = """
import sys, time
from miles.engines.config import EngineConfig
from miles.engines.process import EngineProcess
engine = EngineProcess(EngineConfig(model_path=sys.argv[1]))
engine.start()
print(engine.pid(), flush=True)
time.sleep(600)
"""


def test_engine_dies_when_the_process_that_started_it_is_killed(tiny_model_dir: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        engine_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert not _gone(engine_pid)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 20
        while not _gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(engine_pid), "the engine outlived the process that started it"
    finally:
        parent.kill()
        with_pid = locals().get("engine_pid")
        if with_pid and not _gone(with_pid):
            os.killpg(with_pid, signal.SIGKILL)
