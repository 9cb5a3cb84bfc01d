"""`launcher runs`: run ids are never cut (pipes, narrow terminals), --state and --preset filter,
--all adds the run directories the defaults file lists."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from launcher import api
from launcher.cli import main
from launcher.cli_runs import for_terminal, rows
from launcher.runs import create_run, record_state, record_submission


@pytest.fixture
def bases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    here, elsewhere = tmp_path / "runs", tmp_path / "group-runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(here))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(f"runs_dirs: [{elsewhere}, {here}]\n")
    monkeypatch.setenv("MILES_DEFAULTS", str(defaults))
    a = create_run("tiny-cpu", "local", base=here)
    record_submission(a, "101")
    record_state(a, "RUNNING")
    b = create_run("qwen3-4b-lora-with-a-long-preset-name", "pbs", base=here)
    record_submission(b, "202.pbshead")
    record_state(b, "FAILED", exit_code=2)
    c = create_run("tiny-cpu", "slurm", base=elsewhere)
    record_submission(c, "303")
    record_state(c, "COMPLETED", exit_code=0)
    return here, elsewhere


def run_ids(*args: str) -> list[str]:
    result = CliRunner().invoke(main, ["runs", "--json", *args])
    assert result.exit_code == 0, result.output
    return [r["preset"] + ":" + r["state"] for r in json.loads(result.stdout)]


def test_filters_by_state_and_preset(bases: tuple[Path, Path]) -> None:
    assert sorted(run_ids()) == ["qwen3-4b-lora-with-a-long-preset-name:FAILED", "tiny-cpu:RUNNING"]
    assert run_ids("--state", "running") == ["tiny-cpu:RUNNING"]
    assert run_ids("--state", "FAILED", "--state", "RUNNING", "--preset", "tiny-cpu") == ["tiny-cpu:RUNNING"]
    assert run_ids("--preset", "nothing-like-it") == []


def test_all_adds_the_defaults_files_run_dirs_once(bases: tuple[Path, Path]) -> None:
    everywhere = run_ids("--all")
    assert len(everywhere) == 3 and "tiny-cpu:COMPLETED" in everywhere
    assert run_ids("--all", "--state", "COMPLETED") == ["tiny-cpu:COMPLETED"]


def test_a_pipe_gets_whole_run_ids_whatever_the_width(bases: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(main, ["runs", "--all"], env={"COLUMNS": "20"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["run", "preset"]
    ids = [p.name for base in bases for p in base.iterdir()]
    for run_id in ids:
        assert any(line.startswith(run_id + " ") for line in lines), (run_id, result.stdout)


@pytest.mark.parametrize("width", [30, 50, 97, 98, 140, 200])
def test_a_terminal_of_any_width_shows_whole_run_ids(bases: tuple[Path, Path], width: int) -> None:
    records = [job.record for job in api.runs(everywhere=True)]
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    shown = for_terminal(rows(records), width)
    console.print(shown, soft_wrap=isinstance(shown, str))
    for record in records:
        assert record.run_id in out.getvalue(), out.getvalue()
    assert isinstance(shown, str) == (width < 58 + 40)  # the longest id here is 58 characters
