"""model.path: a directory, or a hub name found offline in the Hugging Face cache; checked at submit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.presets import load_preset
from launcher.submit_checks import submit_problems
from miles.contract.model_source import ModelNotFound, looks_like_hub_name, resolve_model_path

HUB_NAME = "Qwen/Qwen3-4B-Instruct-2507"  # the 4B preset's model
REVISION = "2" * 40


def cache_model(cache: Path, hub_name: str, model_dir: Path, *, complete: bool = True) -> Path:
    repo = cache / f"models--{hub_name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for item in model_dir.iterdir():
        if complete or item.name != "config.json":
            shutil.copy(item, snapshot / item.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.mark.parametrize(
    ("path", "hub"),
    [("Qwen/Qwen3-4B", True), ("/models/qwen", False), ("./Qwen/x", False), ("~/m", False), ("a/b/c", False)],
)
def test_hub_names_are_told_from_paths(path: str, hub: bool) -> None:
    assert looks_like_hub_name(path) is hub


def test_a_hub_name_resolves_to_its_cached_snapshot(tiny_model_dir: Path, tmp_path: Path) -> None:
    snapshot = cache_model(tmp_path / "hf" / "hub", HUB_NAME, tiny_model_dir)
    via_home = resolve_model_path(HUB_NAME, {"HF_HOME": str(tmp_path / "hf")})
    via_cache = resolve_model_path(HUB_NAME, {"HF_HUB_CACHE": str(tmp_path / "hf" / "hub")})
    assert via_home.directory == via_cache.directory == snapshot.resolve()
    assert via_home.hub_name == HUB_NAME


def test_a_directory_is_used_as_is(tiny_model_dir: Path) -> None:
    resolved = resolve_model_path(str(tiny_model_dir), {})
    assert resolved.directory == tiny_model_dir.resolve() and resolved.hub_name is None


def test_an_uncached_hub_name_names_the_cache_and_both_fixes(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as caught:
        resolve_model_path(HUB_NAME, {"HF_HUB_CACHE": str(tmp_path / "empty")})
    message = str(caught.value)
    assert str(tmp_path / "empty") in message
    assert f"huggingface-cli download {HUB_NAME}" in message and "set model.path" in message


def test_a_snapshot_without_config_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache_model(tmp_path / "hub", HUB_NAME, tiny_model_dir, complete=False)
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        resolve_model_path(HUB_NAME, {"HF_HUB_CACHE": str(tmp_path / "hub")})


def test_a_missing_directory_is_not_taken_for_a_hub_name(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model_path(str(tmp_path / "nope"), {})


def test_submit_checks_name_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    big = load_preset("qwen3.8-27b-128k", env={})
    problems = submit_problems(big, {"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert not [p for p in problems if p.startswith("model.backend")]  # megatron is implemented
    assert any("Qwen/Qwen3.8-27B" in p and "huggingface-cli download" in p for p in problems)
    cache_model(tmp_path / "hub", HUB_NAME, tiny_model_dir)
    small = load_preset("qwen3-4b-lora", env={})
    assert submit_problems(small, {"HF_HUB_CACHE": str(tmp_path / "hub")}) == []
    # the preset's own env is what the job sees, so it wins over the submitting shell's
    pointed = load_preset("qwen3-4b-lora", overrides=[f"env.HF_HUB_CACHE={tmp_path / 'hub'}"], env={})
    assert submit_problems(pointed, {"HF_HUB_CACHE": str(tmp_path / "empty")}) == []


def test_submit_refuses_before_anything_is_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    result = CliRunner().invoke(main, ["submit", "--preset", "qwen3.8-27b-128k", "--scheduler", "local"])
    assert result.exit_code != 0
    assert "huggingface-cli download" in result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_sglang_server_args_left_on_a_cpu_engine_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    cache_model(tmp_path / "hub", HUB_NAME, tiny_model_dir)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    switched = load_preset(
        "qwen3-4b-lora", overrides=["engines.kind=cpu"], env={}
    )  # keeps mem_fraction_static
    (problem,) = submit_problems(switched, env)
    assert problem.startswith("engines.server_args:") and "--mem-fraction-static" in problem
    cleared = load_preset("qwen3-4b-lora", overrides=["engines.kind=cpu", "engines.server_args={}"], env={})
    assert submit_problems(cleared, env) == []
    own = load_preset("tiny-cpu", overrides=["engines.server_args={threads: 2}"], env={})  # a CPU engine flag
    assert submit_problems(own, env) == []
