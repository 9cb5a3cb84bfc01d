"""`launcher.api` without a running job: submit (dry run), reattach, list, and its typed errors, which are
the very messages the CLI prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher import api
from launcher.cli import main
from launcher.runs import RunLookupError
from miles.contract.preset import PresetError


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "runs"
    monkeypatch.setenv("MILES_RUNS_DIR", str(base))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    return base


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_submit_with_a_dict_of_overrides_writes_the_resolved_preset(runs_dir: Path) -> None:
    job = api.submit(
        "tiny-cpu",
        scheduler="slurm",
        overrides={"watchdog.dead_probes": 7, "env": {"MY_FLAG": "on"}, "scheduler.slurm.time": "00:10:00"},
        dry_run=True,
    )
    preset = yaml.safe_load(job.run.preset_file.read_text())
    assert preset["watchdog"]["dead_probes"] == 7 and preset["env"]["MY_FLAG"] == "on"
    assert preset["scheduler"]["slurm"]["time"] == "00:10:00"
    assert "#SBATCH --time=00:10:00" in job.run.script.read_text()
    assert job.record.job_id is None and job.record.scheduler == "slurm"

    again = api.Job.load(job.run_id[:20])
    assert again.run_id == job.run_id and [j.run_id for j in api.runs()] == [job.run_id]
    assert again.status().state == "NOT_SUBMITTED"


def test_override_strings_keep_strings_and_write_other_values_as_yaml() -> None:
    assert api.override_strings({"a.b": 2, "c": True, "d": "x: y", "e": None, "f": [1, "z"]}) == [
        "a.b=2",
        "c=true",
        "d=x: y",
        "e=null",
        'f=[1, "z"]',
    ]
    assert api.override_strings(["a=1"]) == ["a=1"]


def test_errors_are_typed_and_the_cli_prints_the_same_message(runs_dir: Path) -> None:
    with pytest.raises(PresetError, match="bogus") as bad_key:
        api.submit("tiny-cpu", overrides={"watchdog.bogus": 1})
    code, out = cli("submit", "-p", "tiny-cpu", "--set", "watchdog.bogus=1")
    assert code != 0 and str(bad_key.value).splitlines()[0] in out

    with pytest.raises(RunLookupError, match="no run matches 'nope'") as missing:
        api.Job.load("nope")
    code, out = cli("wait", "nope")
    assert code != 0 and str(missing.value) in out

    job = api.submit("tiny-cpu", dry_run=True)
    with pytest.raises(api.JobError, match="never submitted") as never:
        job.cancel()
    code, out = cli("cancel", job.run_id)
    assert code != 0 and str(never.value) in out
    with pytest.raises(api.JobError, match="nothing to wait for"):
        job.wait()
    with pytest.raises(api.NotServing, match=r"job.wait\(\)"):
        job.tinker_service_client()
    with pytest.raises(api.JobError, match="no 'driver' log"):
        job.logs("driver")
    assert all(issubclass(e, Exception) for e in api.API_ERRORS)


def test_pbs_submit_with_the_placeholder_project_is_refused_typed(runs_dir: Path) -> None:
    with pytest.raises(api.SubmitRefused, match="placeholder YOUR_ABCI_GROUP"):
        api.submit("tiny-cpu", scheduler="pbs", overrides={"scheduler.pbs.project": "YOUR_ABCI_GROUP"})
    assert api.runs() == []
    dry = api.submit(
        "tiny-cpu", scheduler="pbs", overrides={"scheduler.pbs.project": "YOUR_ABCI_GROUP"}, dry_run=True
    )
    assert any("YOUR_ABCI_GROUP" in w for w in dry.warnings)


def test_submit_wait_refuses_a_dry_run(runs_dir: Path) -> None:
    code, out = cli("submit", "-p", "tiny-cpu", "--dry-run", "--wait")
    assert code == 2 and "drop --dry-run or --wait" in out
    assert api.runs() == []
