"""Engine launch details that need no process: argv, environment, cells from placed bundles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.cluster.ordering import BundleLocation
from miles.rollout.config import EngineConfig
from miles.rollout.engine_cell import EngineCell, engine_cells_for
from miles.rollout.engine_process import EngineProcess


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


def test_cells_from_allocated_engine_bundles(tmp_path: Path) -> None:
    config = EngineConfig(model_path=str(tmp_path), gpus_per_engine=2)
    groups = [
        [BundleLocation(4, "10.0.0.3", 0), BundleLocation(2, "10.0.0.3", 1)],
        [BundleLocation(0, "10.0.0.1", 0), BundleLocation(1, "10.0.0.1", 1)],
    ]
    pg = object()
    cells = engine_cells_for(pg, groups, config)  # type: ignore[arg-type]
    assert [(c.index, c.bundle, c.gpu_ids) for c in cells] == [(0, (pg, 4), (0, 1)), (1, (pg, 0), (0, 1))]
    with pytest.raises(ValueError, match="gpus_per_engine is 2"):
        EngineCell(0, config, gpu_ids=[0])
