"""The user's defaults file: over the preset, under the environment and --set; `presets show --resolved`
names each value's source; submit and render use it; a bad file is refused with its path and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli import main
from launcher.defaults import DefaultsError, load_defaults, load_user_preset
from miles.contract import strict_yaml

PRESET = (
    "name: t\nmodel: {name: m, init: tiny}\nengines: {kind: cpu}\n"
    "scheduler: {pbs: {project: gpreset, queue: qpreset}, slurm: {partition: ppreset}}\n"
)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A home without a defaults file, and a defaults file named by MILES_DEFAULTS."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(
        "scheduler:\n  pbs: {project: gdefault, walltime: 12:00:00}\n  slurm: {account: adefault}\n"
    )
    (tmp_path / "p.yaml").write_text(PRESET)
    monkeypatch.setenv("MILES_DEFAULTS", str(defaults))
    return {"MILES_DEFAULTS": str(defaults), "PRESET": str(tmp_path / "p.yaml")}


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def test_defaults_apply_over_the_preset_and_under_set(env: dict[str, str]) -> None:
    preset = load_user_preset(env["PRESET"], ["scheduler.slurm.account=aset"], env={**env})
    pbs, slurm = preset.scheduler.pbs, preset.scheduler.slurm
    assert (pbs.project, pbs.queue, pbs.walltime) == ("gdefault", "qpreset", "12:00:00")
    assert (slurm.account, slurm.partition) == ("aset", "ppreset")


def test_an_empty_section_of_the_defaults_file_sets_nothing(env: dict[str, str]) -> None:
    Path(env["MILES_DEFAULTS"]).write_text("scheduler:\n  pbs: {}\n  slurm: {account: a1}\n")
    preset = load_user_preset(env["PRESET"], env={**env})
    assert (preset.scheduler.pbs.project, preset.scheduler.pbs.queue) == ("gpreset", "qpreset")
    assert preset.scheduler.slurm.account == "a1"


def test_the_default_location_is_the_users_config(tmp_path: Path) -> None:
    config = tmp_path / "xdg" / "miles"
    assert load_defaults({"XDG_CONFIG_HOME": str(tmp_path / "xdg")}).path is None
    config.mkdir(parents=True)
    (config / "defaults.yaml").write_text("scheduler: {slurm: {partition: gpu}}\nruns_dirs: [~/elsewhere]\n")
    found = load_defaults({"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)})
    assert found.preset == {"scheduler": {"slurm": {"partition": "gpu"}}}
    assert found.runs_dirs == (Path("~/elsewhere").expanduser(),)
    home = load_defaults({"HOME": str(tmp_path / "h")})
    assert home.path is None


def test_presets_show_resolved_names_each_values_source(env: dict[str, str]) -> None:
    code, out = invoke(
        "presets", "show", env["PRESET"], "--resolved", "--set", "scheduler.pbs.queue=qset",
        env={"GATEWAY_DEAD_PROBES": "3"},
    )  # fmt: skip
    assert code == 0, out
    lines = {line.strip().split(":")[0]: line for line in out.splitlines()}
    assert lines["project"].endswith(f'"gdefault"  # defaults file {env["MILES_DEFAULTS"]}')
    assert lines["queue"].endswith('"qset"  # --set')
    assert lines["partition"].endswith('"ppreset"  # preset')
    assert lines["dead_probes"].endswith("3  # environment")
    assert lines["probe_interval_s"].endswith("# default")
    data = strict_yaml.load(out)  # the annotated form is still the resolved preset
    assert data["scheduler"]["pbs"]["project"] == "gdefault" and data["watchdog"]["dead_probes"] == 3
    code, plain = invoke("presets", "show", env["PRESET"], "--json")
    assert json.loads(plain)["scheduler"]["pbs"]["project"] == "gdefault"


def test_render_and_submit_use_the_defaults(env: dict[str, str], tmp_path: Path) -> None:
    code, script = invoke("render", "--preset", env["PRESET"], "--scheduler", "pbs")
    assert code == 0 and "#PBS -P gdefault" in script and "#PBS -l walltime=12:00:00" in script
    code, out = invoke("submit", "--preset", env["PRESET"], "--scheduler", "slurm", "--dry-run", "--json")
    assert code == 0, out
    written = yaml.safe_load(Path(json.loads(out)["preset_file"]).read_text())
    assert written["scheduler"]["slurm"]["account"] == "adefault"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: 4\n", "unknown key(s) nodes: a defaults file holds scheduler, runs_dirs"),
        ("scheduler: {pbs: {walltime: forever}}\n", "scheduler.pbs.walltime: 'forever' is not a walltime"),
        ("scheduler: {slurm: {acount: x}}\n", "scheduler.slurm.acount: unknown key"),
        ("scheduler: {pbs: {whole_nodes: yes}}\n", "scheduler.pbs.whole_nodes: 'yes' is not a boolean"),
        ("runs_dirs: /one/dir\n", "runs_dirs is a list of directory paths"),
        ("- a list\n", "a defaults file is a YAML mapping"),
    ],
)
def test_a_bad_defaults_file_is_refused_naming_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(DefaultsError) as caught:
        load_defaults({"MILES_DEFAULTS": str(path)})
    assert str(path) in str(caught.value) and message in str(caught.value)


def test_a_missing_named_defaults_file_is_an_error(tmp_path: Path) -> None:
    code, out = invoke("render", "--preset", "tiny-cpu", "--scheduler", "slurm",
                       env={"MILES_DEFAULTS": str(tmp_path / "nope.yaml")})  # fmt: skip
    assert code == 1 and "MILES_DEFAULTS=" in out and "no such file" in out and "Traceback" not in out


def test_the_job_never_reads_the_defaults_file(env: dict[str, str]) -> None:
    """The runtime loads the resolved preset with load_preset: the defaults file does not apply there."""
    from launcher.presets import load_preset

    assert load_preset(env["PRESET"], env={**env}).scheduler.pbs.project == "gpreset"
