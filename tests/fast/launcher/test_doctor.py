"""`launcher doctor` against the real local Slurm and OpenPBS, the real job Python and bash: each check
passes where the thing works and fails (with a fix) where it does not; exit 0 only without failures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher import doctor
from launcher.cli import main
from launcher.presets import load_preset

SLURM_CONF = "/tmp/slurm-local/etc/slurm.conf"
needs_slurm = pytest.mark.skipif(
    not (shutil.which("sinfo") and Path(SLURM_CONF).is_file()), reason="the local Slurm is not here"
)
needs_pbs = pytest.mark.skipif(not Path("/etc/pbs.conf").is_file(), reason="the local OpenPBS is not here")


@pytest.fixture(autouse=True)
def quiet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("MILES_DEFAULTS", raising=False)
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)


@needs_slurm
def test_slurm_answers_and_a_broken_config_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_CONF", SLURM_CONF)
    check = doctor.check_slurm()
    assert check.status == doctor.OK and "debug" in check.detail
    broken = tmp_path / "slurm.conf"
    broken.write_text("ClusterName=nowhere\nSlurmctldHost=127.0.0.1\nSlurmctldPort=1\n")
    monkeypatch.setenv("SLURM_CONF", str(broken))
    failed = doctor.check_slurm()
    assert failed.status == doctor.FAIL and "sinfo does not answer" in failed.detail and failed.fix


@needs_pbs
def test_pbs_answers_through_pbs_conf_and_a_wrong_bin_dir_fails(tmp_path: Path) -> None:
    check = doctor.check_pbs({"PBS_CONF_FILE": "/etc/pbs.conf"})
    assert check.status == doctor.OK and "qsub" in check.detail and "answers" in check.detail
    failed = doctor.check_pbs({"MILES_PBS_BIN": str(tmp_path)})
    assert failed.status == doctor.FAIL and "qsub" in failed.detail and "MILES_PBS_BIN" in failed.fix


def test_the_run_dir_is_warned_about_when_node_local(tmp_path: Path) -> None:
    mounts = (
        "/dev/sda1 / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\nfs@o2ib:/lustre /groups lustre rw 0 0\n"
    )
    assert doctor.check_run_dir(Path("/home/me/runs"), ["pbs"], mounts).status == doctor.OK
    assert "lustre" in doctor.check_run_dir(Path("/groups/g/runs"), ["slurm"], mounts).detail
    under_tmp = doctor.check_run_dir(tmp_path / "runs", ["slurm"], mounts)
    assert (
        under_tmp.status == doctor.WARN
        and "node-local" in under_tmp.detail
        and "MILES_RUNS_DIR" in under_tmp.fix
    )
    assert doctor.check_run_dir(tmp_path / "runs", ["local"], mounts).status == doctor.OK
    assert doctor.check_run_dir(Path("/srv/runs"), ["pbs"], mounts).status == doctor.WARN  # ext4 root


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_run_dir_fails(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert doctor.check_run_dir(locked / "runs", ["slurm"], "").status == doctor.FAIL


def test_the_job_python_must_import_the_runtime() -> None:
    good = doctor.check_job_python(sys.executable, load_preset("tiny-cpu", env={}))
    assert good.status == doctor.OK and "torch" in good.detail and "miles.engines.cpu.server" in good.detail
    bare = shutil.which("python3", path="/usr/bin")
    if bare is None:
        pytest.skip("no system python3 without the runtime")
    failed = doctor.check_job_python(bare, None)
    assert failed.status == doctor.FAIL and "No module named" in failed.detail
    assert "pip install 'miles-hpc[runtime]'" in failed.fix


def test_the_model_must_resolve(tmp_path: Path) -> None:
    empty_cache = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    hub = load_preset("qwen3-4b-lora", env={})
    failed = doctor.check_model(hub, empty_cache)
    assert failed.status == doctor.FAIL and "Qwen/Qwen3-4B-Instruct-2507" in failed.detail
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    pointed = load_preset("qwen3-4b-lora", [f"model.path={local}"], env={})
    assert doctor.check_model(pointed, empty_cache).status == doctor.OK
    assert doctor.check_model(None, {}).status == doctor.SKIP


def test_a_fixed_port_in_use_fails_and_the_ephemeral_overlap_warns() -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        busy = doctor.check_ports(load_preset("tiny-cpu", [f"gateway.port={port}"], env={}), "32768 60999")
        assert busy.status == doctor.FAIL and f"gateway.port {port}" in busy.detail
    assert doctor.check_ports(None, "32768\t60999").status == doctor.OK
    overlap = doctor.check_ports(None, "15000 65000")
    assert overlap.status == doctor.WARN and "overlaps" in overlap.detail


def test_bash_versions() -> None:
    assert doctor.bash_version("GNU bash, version 5.2.15(1)-release") == (5, 2)
    assert doctor.bash_version("GNU bash, version 4.2.46(2)-release") < doctor.MIN_BASH
    assert doctor.check_bash().status == doctor.OK  # this machine's /bin/bash runs the job scripts
    assert doctor.check_bash("/no/such/bash").status == doctor.FAIL


@needs_slurm
@needs_pbs
def test_the_command_prints_one_line_per_check_and_exits_by_failures(tmp_path: Path) -> None:
    env = {"SLURM_CONF": SLURM_CONF, "PBS_CONF_FILE": "/etc/pbs.conf", "MILES_RUNS_DIR": str(tmp_path / "r")}
    result = CliRunner().invoke(main, ["doctor", "--preset", "tiny-cpu", "--json"], env=env)
    checks = json.loads(result.stdout)
    names = [c["name"] for c in checks]
    assert {"launcher", "pbs", "slurm", "run dir", "job python", "preset", "model", "ports", "bash"} <= set(
        names
    )
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in checks)
    assert result.exit_code == (1 if any(c["status"] == "fail" for c in checks) else 0)
    assert next(c for c in checks if c["name"] == "run dir")["status"] == "warn"  # under /tmp
    text = CliRunner().invoke(main, ["doctor", "--scheduler", "pbs", "--python", "/usr/bin/python3"], env=env)
    assert text.exit_code == 1
    assert any(line.startswith("[FAIL] job python:") and "->" in line for line in text.stdout.splitlines())
    assert "[ok  ] pbs:" in text.stdout and "slurm" not in text.stdout


def test_what_submit_would_refuse_is_a_failed_preset_check() -> None:
    abci = load_preset("qwen3-4b-lora", env={})  # ships the YOUR_ABCI_GROUP placeholder
    refused = doctor.check_preset(abci, ["pbs"])
    assert refused.status == doctor.FAIL and "placeholder YOUR_ABCI_GROUP" in refused.detail
    assert doctor.check_preset(abci, ["slurm"]).status == doctor.OK  # no PBS project on Slurm
    mine = load_preset("qwen3-4b-lora", ["scheduler.pbs.project=gabc1234"], env={})
    assert doctor.check_preset(mine, ["pbs"]).status == doctor.OK
    megatron = load_preset("tiny-cpu", ["model.backend=megatron"], env={})  # tiny-cpu trains LoRA
    assert doctor.check_preset(megatron, ["local"]).status == doctor.OK  # megatron trains adapters too
    assert doctor.check_preset(None, ["pbs"]).status == doctor.SKIP


@needs_pbs
def test_set_overrides_reach_the_checked_preset() -> None:
    args = [
        "doctor",
        "--scheduler",
        "pbs",
        "--python",
        "/usr/bin/python3",
        "--preset",
        "qwen3-4b-lora",
        "--json",
    ]
    env = {"PBS_CONF_FILE": "/etc/pbs.conf"}

    def preset_status(*extra: str) -> str:
        result = CliRunner().invoke(main, [*args, *extra], env=env)
        return next(c["status"] for c in json.loads(result.stdout) if c["name"] == "preset")

    assert preset_status() == "fail"
    assert preset_status("--set", "scheduler.pbs.project=gabc1234") == "ok"
    assert CliRunner().invoke(main, ["doctor", "--set", "nodes=2"]).exit_code == 2
