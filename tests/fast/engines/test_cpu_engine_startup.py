"""CPU engine startup: keep-alive from SGLANG_TIMEOUT_KEEP_ALIVE, /health 503 until a model is loaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from miles.engines.cpu.__main__ import keepalive_from_env, main
from miles.engines.cpu.server import create_app
from miles.utils.serving import ServerThread


def test_keepalive_follows_sglang_env() -> None:
    assert keepalive_from_env({}) == 5  # SGLang's default when unset
    assert keepalive_from_env({"SGLANG_TIMEOUT_KEEP_ALIVE": "600"}) == 600
    with pytest.raises(SystemExit, match="not a number"):
        keepalive_from_env({"SGLANG_TIMEOUT_KEEP_ALIVE": "ten"})


def test_missing_model_dir_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--model-path", str(tmp_path / "nope"), "--port", "1"])
    assert "is not a directory" in capsys.readouterr().err


def test_health_is_503_while_no_model_is_loaded(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with ServerThread(create_app(str(tmp_path))) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health").status_code == 503
        failed = http.post("/generate", json={"input_ids": [1], "sampling_params": {}})
        assert failed.status_code == 400 and "failed to load" in failed.json()["error"]["message"]
        assert http.get("/health").status_code == 503
