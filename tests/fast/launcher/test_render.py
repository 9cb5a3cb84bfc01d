"""Rendered job scripts: valid bash for every preset and scheduler, golden snapshots, inert values.

Regenerate the golden snapshots after an intended template change with
`MILES_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/fast/launcher/test_render.py` and review the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.presets import list_presets, load_preset
from launcher.render import RenderError, render_job_script

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/scratch/runs/golden-run")  # fixed so snapshots are deterministic
PYTHON = "/opt/miles/venv/bin/python"
NO_ENV: dict[str, str] = {}


def schedulers_for(name: str) -> list[str]:
    return ["pbs", "slurm", "local"] if load_preset(name, env=NO_ENV).nodes == 1 else ["pbs", "slurm"]


CASES = [(name, scheduler) for name in list_presets() for scheduler in schedulers_for(name)]


def bash_syntax_ok(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sh"
    path.write_text(script)
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize(("name", "scheduler"), CASES)
def test_every_preset_renders_valid_bash(name: str, scheduler: str, tmp_path: Path) -> None:
    script = render_job_script(load_preset(name, env=NO_ENV), scheduler, RUN_DIR, PYTHON)
    checked = bash_syntax_ok(script, tmp_path)
    assert checked.returncode == 0, checked.stderr


def ray_node_script(job_script: str) -> str:
    """The ray-node.sh a job script writes (its quoted here-document)."""
    body = job_script.split("<<'RAY_NODE_EOF'\n", 1)[1]
    return body.split("\nRAY_NODE_EOF\n", 1)[0] + "\n"


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt: shellcheck)"
)
@pytest.mark.parametrize(("name", "scheduler"), CASES)
def test_every_rendered_script_passes_shellcheck(name: str, scheduler: str, tmp_path: Path) -> None:
    script = render_job_script(load_preset(name, env=NO_ENV), scheduler, RUN_DIR, PYTHON)
    (tmp_path / "job.sh").write_text(script)
    (tmp_path / "ray-node.sh").write_text(ray_node_script(script))
    for path in (tmp_path / "job.sh", tmp_path / "ray-node.sh"):
        checked = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{path.name}:\n{checked.stdout}"


@pytest.mark.parametrize(("name", "scheduler"), CASES)
def test_golden_snapshot(name: str, scheduler: str) -> None:
    script = render_job_script(load_preset(name, env=NO_ENV), scheduler, RUN_DIR, PYTHON)
    golden = GOLDEN / f"{name}.{scheduler}.sh"
    if os.environ.get("MILES_UPDATE_GOLDEN") == "1":
        golden.write_text(script)
    assert golden.exists(), f"missing {golden}: run with MILES_UPDATE_GOLDEN=1 to create it"
    assert script == golden.read_text(), (
        f"{golden} differs: if intended, regenerate with MILES_UPDATE_GOLDEN=1"
    )


def test_directives_follow_the_preset() -> None:
    preset = load_preset(
        "qwen3.8-27b-128k",
        ["scheduler.pbs.project=gaa5", "scheduler.slurm.partition=gpu"],
        env=NO_ENV,
    )
    pbs = render_job_script(preset, "pbs", RUN_DIR, PYTHON)
    # ABCI's documented form: the rt_HF queue defines the node, so no chunk resources and no place
    for line in [
        "#PBS -P gaa5",
        "#PBS -q rt_HF",
        "#PBS -l select=10",
        "#PBS -l walltime=12:00:00",
        "#PBS -r n",
    ]:
        assert f"\n{line}\n" in pbs
    assert "-l place=" not in pbs and "ngpus" not in pbs
    slurm = render_job_script(preset, "slurm", RUN_DIR, PYTHON)
    for line in ["#SBATCH --nodes=10", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8"]:
        assert f"\n{line}\n" in slurm
    for line in [
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --no-requeue",
    ]:
        assert f"\n{line}\n" in slurm  # a GPU preset owns its nodes; walltime notice; no silent requeue
    # each template reads only its own scheduler's variables (the local Slurm cluster sets both)
    assert not re.search(r"\$\{?SLURM_", pbs) and not re.search(r"\$\{?PBS_", slurm)


def test_pbs_chunk_resources_place_and_rerun_on_a_site_without_whole_node_queues() -> None:
    sets = [
        "scheduler.pbs.whole_nodes=false",
        "scheduler.pbs.ncpus=96",
        "scheduler.pbs.select_extras=:mem=900gb",
    ]
    preset = load_preset("qwen3.8-27b-128k", [*sets, "scheduler.pbs.rerunnable=true"], env=NO_ENV)
    pbs = render_job_script(preset, "pbs", RUN_DIR, PYTHON)
    assert "\n#PBS -l select=10:ncpus=96:ngpus=8:mem=900gb\n" in pbs  # ngpus from gpus_per_node
    assert "\n#PBS -l place=scatter:excl\n" in pbs and "\n#PBS -r y\n" in pbs
    assert "\nNODE_CPUS=96\n" in pbs  # Ray is told the chunk's CPUs
    shared = load_preset("qwen3.8-27b-128k", [*sets, "scheduler.pbs.place=scatter:shared"], env=NO_ENV)
    assert "\n#PBS -l place=scatter:shared\n" in render_job_script(shared, "pbs", RUN_DIR, PYTHON)
    with pytest.raises(Exception, match=r"scheduler\.pbs\.ncpus"):
        load_preset("tiny-cpu", ["scheduler.pbs.select_extras=:ncpus=4"], env=NO_ENV)


def test_slurm_resources_cpu_job_and_opt_ins() -> None:
    tiny = render_job_script(load_preset("tiny-cpu", env=NO_ENV), "slurm", RUN_DIR, PYTHON)
    assert "--exclusive" not in tiny and "--mem" not in tiny and "--gpus-per-node" not in tiny
    sets = ["scheduler.slurm.cpus_per_task=8", "scheduler.slurm.mem=32G", "scheduler.slurm.requeue=true"]
    chosen = load_preset("tiny-cpu", [*sets, "scheduler.slurm.signal=B:USR2@300"], env=NO_ENV)
    script = render_job_script(chosen, "slurm", RUN_DIR, PYTHON)
    for line in ["--cpus-per-task=8", "--mem=32G", "--requeue", "--signal=B:USR2@300"]:
        assert f"\n#SBATCH {line}\n" in script
    with pytest.raises(Exception, match="signal must look like"):
        load_preset("tiny-cpu", ["scheduler.slurm.signal=USR1"], env=NO_ENV)


@pytest.mark.parametrize("launch", ["pbs_tmrsh", "pbsdsh", "mpirun", "ssh"])
def test_pbs_launch_modes_use_pbs_professional_syntax(launch: str) -> None:
    preset = load_preset("tiny-cpu", [f"scheduler.pbs.launch={launch}"], env=NO_ENV)
    script = render_job_script(preset, "pbs", RUN_DIR, PYTHON)
    assert f"\nPBS_LAUNCH={launch}\n" in script
    assert "pbsdsh -h" not in script and 'pbsdsh)" -n "$index" --' in script  # never Torque's -h
    assert '"$(pbs_command pbs_tmrsh)" "$node" "$@"' in script
    assert "--bind-to none" in script and "I_MPI_PIN=0" in script


def test_render_refuses_what_cannot_work() -> None:
    big = load_preset("qwen3-4b-lora", env=NO_ENV)
    with pytest.raises(RenderError, match="local scheduler runs one node"):
        render_job_script(big, "local", RUN_DIR, PYTHON)
    with pytest.raises(RenderError, match="must be absolute"):
        render_job_script(big, "slurm", Path("relative/run"), PYTHON)
    newline = load_preset("tiny-cpu", env=NO_ENV)
    newline.scheduler.slurm.job_name = "a\ntouch /tmp/x"
    with pytest.raises(RenderError, match="control character"):
        render_job_script(newline, "slurm", RUN_DIR, PYTHON)


# ---------------------------------------------------------------- injection


def hostile_preset(marker: Path, scheduler: str) -> tuple[object, dict[str, str]]:
    """A preset whose free-text values all try to run `touch MARKER`."""
    attack = f"$(touch {marker})`touch {marker}`;touch {marker}"
    quoted = shlex.quote(attack)
    overrides = [
        f"scheduler.{scheduler if scheduler != 'local' else 'slurm'}.job_name={quoted}",
        f"scheduler.pbs.project={quoted}",
        f"scheduler.slurm.extra_directives=[{quoted}]",
        f"scheduler.pbs.extra_directives=[{quoted}]",
        f"model.path={quoted}",
        f"env.EVIL={quoted}",
        f"env.SEMI={shlex.quote('a;b')}",
        f"driver.command=[python, {quoted}]",
        f"services.command=[sh, -c, {quoted}]",
        f"gateway.host={quoted}",
    ]
    return load_preset("tiny-cpu", overrides, env=NO_ENV), {"EVIL": attack, "SEMI": "a;b"}


@pytest.mark.parametrize("scheduler", ["pbs", "slurm", "local"])
def test_hostile_values_stay_inert_when_the_script_runs(scheduler: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    preset, expected_env = hostile_preset(marker, scheduler)
    run_dir = tmp_path / "run $(touch x) dir"
    script = render_job_script(preset, scheduler, run_dir, PYTHON)
    path = tmp_path / "job.sh"
    path.write_text(script)
    env = {
        "PATH": os.environ["PATH"],
        "MILES_JOB_CHECK_ONLY": "1",  # evaluate every setting, start nothing
        "SLURM_JOB_ID": "7",
        "PBS_JOBID": "7.pbs1",
    }
    done = subprocess.run(
        ["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert not marker.exists() and not (tmp_path / "x").exists()
    lines = done.stdout.splitlines()
    for key, value in expected_env.items():
        assert f"{key}={value}" in lines  # the value arrives byte for byte
    assert f'declare -- RUN_DIR="{run_dir}"' in done.stdout.replace("\\$", "$").replace("\\`", "`")
    assert "touch" in done.stdout  # the driver argv kept the text as one word
    assert done.stdout.count('declare -a DRIVER_CMD=([0]="python" [1]=') == 1


def test_hostile_job_env_file_round_trips(tmp_path: Path) -> None:
    """job.env (read by ray-node.sh on other nodes) quotes values too: source it and compare."""
    marker = tmp_path / "pwned"
    preset, expected_env = hostile_preset(marker, "slurm")
    script = render_job_script(preset, "slurm", tmp_path / "run", PYTHON)
    start = script.index("write_job_env() {")
    end = script.index("\n}\n", start) + 3
    harness = "\n".join(
        [
            script[: script.index('if [[ "${MILES_JOB_CHECK_ONLY')],  # the settings block
            "JOB_KEY=7 JOB_LABEL=l HEAD=n1 HEAD_IP=127.0.0.2 RAY_BIN=/x/ray RAY_ADDRESS=a",
            "MILES_GATEWAY_URL=u RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/r/ray-auth-token",
            f"mkdir -p {shlex.quote(str(tmp_path / 'run'))}",
            script[start:end],
            "write_job_env",
            'env -i bash -c \'source "$1"; env\' _ "$RUN_DIR/job.env"',
        ]
    )
    done = subprocess.run(
        ["bash", "-c", harness],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7"},
    )
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    for key, value in expected_env.items():
        assert f"{key}={value}" in done.stdout.splitlines()


# ---------------------------------------------------------------- CLI


def test_cli_render_to_stdout_and_file(tmp_path: Path) -> None:
    runner = CliRunner(env={"GATEWAY_DEAD_PROBES": None})
    out = runner.invoke(main, ["render", "--preset", "qwen3-4b-lora", "--scheduler", "slurm"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("#!/bin/bash\n#SBATCH --job-name=miles-qwen3-4b-lora\n")
    target = tmp_path / "job.pbs"
    args = ["render", "--preset", "qwen3-4b-lora", "--scheduler", "pbs", "--set", "scheduler.pbs.project=gx"]
    written = runner.invoke(main, [*args, "-o", str(target), "--run-dir", str(tmp_path / "r")])
    assert written.exit_code == 0, written.output
    text = target.read_text()
    assert "#PBS -P gx\n" in text and f"RUN_DIR={tmp_path / 'r'}\n" in text
    assert os.access(target, os.X_OK)


def test_cli_render_to_a_device_leaves_the_device_alone() -> None:
    """`-o /dev/null` (a dry check) must not make /dev/null a 0755 file that other users cannot write."""
    mode = os.stat("/dev/null").st_mode
    try:
        args = ["render", "--preset", "tiny-cpu", "--scheduler", "slurm", "-o", "/dev/null"]
        result = CliRunner(env={"GATEWAY_DEAD_PROBES": None}).invoke(main, args)
        assert result.exit_code == 0, result.output
        assert os.stat("/dev/null").st_mode == mode
    finally:
        if os.stat("/dev/null").st_mode != mode and os.geteuid() == 0:
            os.chmod("/dev/null", mode & 0o7777)  # undo a regression, or the rest of the run breaks


def test_cli_render_errors_exit_non_zero() -> None:
    runner = CliRunner(env={"GATEWAY_DEAD_PROBES": None})
    bad_set = runner.invoke(
        main, ["render", "--preset", "tiny-cpu", "--scheduler", "slurm", "--set", "x.y=1"]
    )
    assert bad_set.exit_code == 1 and "unknown key 'x'" in bad_set.output
    bad_sched = runner.invoke(main, ["render", "--preset", "tiny-cpu", "--scheduler", "lsf"])
    assert bad_sched.exit_code == 2 and "lsf" in bad_sched.output
    bad_env = runner.invoke(
        main, ["render", "--preset", "tiny-cpu", "--scheduler", "slurm"], env={"GATEWAY_DEAD_PROBES": "08"}
    )
    assert bad_env.exit_code == 1 and "GATEWAY_DEAD_PROBES='08'" in bad_env.output
