"""engine_env: the keep-alive default, the operator's override, per-engine extras."""

from __future__ import annotations

import pytest

from miles.engines.env import ENGINE_ENV_DEFAULTS, engine_env


def test_keepalive_defaults_to_600_and_keeps_the_driver_environment() -> None:
    env = engine_env(base={"PATH": "/bin", "HOME": "/h"})
    assert env["SGLANG_TIMEOUT_KEEP_ALIVE"] == "600"
    assert env["PATH"] == "/bin" and env["HOME"] == "/h"
    for key, value in ENGINE_ENV_DEFAULTS.items():
        assert env[key] == value


def test_operator_value_wins_over_defaults() -> None:
    env = engine_env(base={"SGLANG_TIMEOUT_KEEP_ALIVE": "90", "TOKENIZERS_PARALLELISM": "true"})
    assert env["SGLANG_TIMEOUT_KEEP_ALIVE"] == "90"
    assert env["TOKENIZERS_PARALLELISM"] == "true"


def test_default_base_is_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "33")
    monkeypatch.setenv("MILES_TEST_MARKER", "x")
    env = engine_env()
    assert env["SGLANG_TIMEOUT_KEEP_ALIVE"] == "33" and env["MILES_TEST_MARKER"] == "x"
    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE")
    assert engine_env()["SGLANG_TIMEOUT_KEEP_ALIVE"] == "600"


def test_extra_is_per_engine_and_overrides() -> None:
    env = engine_env(base={}, extra={"CUDA_VISIBLE_DEVICES": "3", "PYTHONUNBUFFERED": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PYTHONUNBUFFERED"] == "0"


def test_non_numeric_keepalive_is_refused() -> None:
    with pytest.raises(ValueError, match="SGLANG_TIMEOUT_KEEP_ALIVE='soon'"):
        engine_env(base={"SGLANG_TIMEOUT_KEEP_ALIVE": "soon"})
