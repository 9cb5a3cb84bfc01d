"""Every command's errors: one clean line and exit 1, never a traceback; under --json an
{"error", "hint"} object on stdout. The cases are the ones a user meets first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher import render
from launcher.cli import main
from launcher.cli_errors import installed_everywhere
from launcher.doctor import installed_version


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("MILES_DEFAULTS", raising=False)
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)


def launcher(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line, so a traceback would show on stderr."""
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], capture_output=True, text=True, env=env, check=False
    )


def assert_one_clean_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_every_command_goes_through_the_shared_error_handler() -> None:
    assert installed_everywhere(main) == []


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and installed_version() in result.output and "0." in result.output


def test_an_unwritable_output_path(tmp_path: Path) -> None:
    target = tmp_path / "missing-dir" / "job.sh"
    result = launcher("render", "--preset", "tiny-cpu", "--scheduler", "slurm", "-o", str(target))
    assert_one_clean_line(result, str(target), "No such file or directory", "hint:")


def test_a_preset_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    result = launcher("presets", "validate", str(path))
    assert_one_clean_line(result, "not UTF-8 text", "save the file as UTF-8")
    shown = launcher("presets", "show", str(path))
    assert shown.returncode == 1 and "Traceback" not in shown.stderr


def test_an_unusable_runs_directory(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    env = {**os.environ, "MILES_RUNS_DIR": str(not_a_dir / "runs")}
    result = launcher("submit", "--preset", "tiny-cpu", "--dry-run", env=env)
    assert_one_clean_line(result, "Not a directory", "MILES_RUNS_DIR")


def test_a_missing_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "TEMPLATES_DIR", tmp_path / "no-templates")
    result = CliRunner().invoke(main, ["render", "--preset", "tiny-cpu", "--scheduler", "pbs"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "job script template pbs/job.sh.j2 not found" in result.output
    assert "reinstall miles-hpc" in result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["presets", "show", "no-such-preset", "--json"], "unknown preset 'no-such-preset'"),
        (["presets", "validate", "--json", "{file}"], "nodes: 'yes' is not an integer"),
        (["status", "no-such-run", "--json"], "no run matches 'no-such-run'"),
        (
            ["submit", "--preset", "tiny-cpu", "--set", "nodes=010", "--json"],
            "nodes: '010' is not an integer",
        ),
        (["doctor", "--preset", "no-such-preset", "--json"], "unknown preset"),
        (  # valid for a cluster, not for the local scheduler's one node: refused at submit, no traceback
            ["submit", "--preset", "tiny-cpu", "--set", "nodes=2", "--scheduler", "local", "--json"],
            "the local scheduler runs one node",
        ),
    ],
)
def test_json_errors_are_objects_on_stdout(tmp_path: Path, args: list[str], needle: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nnodes: yes\nmodel: {name: m, init: tiny}\n")
    result = CliRunner().invoke(main, [a.replace("{file}", str(bad)) for a in args])
    assert result.exit_code == 1
    error = json.loads(result.stdout)
    assert set(error) == {"error", "hint"} and needle in error["error"]
    assert error["hint"] is None or isinstance(error["hint"], str)


def test_without_json_the_same_error_is_text_on_stderr() -> None:
    result = CliRunner().invoke(main, ["status", "no-such-run"])
    assert result.exit_code == 1 and result.stdout == ""
    assert (
        result.stderr.startswith("Error: no run matches 'no-such-run'") and "launcher runs" in result.stderr
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["submit", "--preset", "tiny-cpu", "--scheduler", "pbz", "--json"], "'pbz' is not one of"),
        (["status", "--json"], "Missing argument 'RUN'"),
        (["runs", "--json", "--colour"], "--colour"),
    ],
)
def test_json_usage_errors_are_objects_too(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    error = json.loads(result.stdout)
    assert needle in error["error"] and "--help" in error["hint"]
    plain = CliRunner().invoke(main, [a for a in args if a != "--json"])
    assert plain.exit_code == 2 and "Usage:" in plain.output  # without --json click's usage text stays
