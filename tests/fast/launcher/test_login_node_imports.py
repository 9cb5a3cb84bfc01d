"""A login node has the launcher only (`pip install miles-hpc`, no `runtime` extra): the launcher's commands
must work with the runtime's heavy packages absent. Each case runs in a fresh interpreter whose importer
refuses those packages, as a venv without them would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# the `runtime` extra's packages (pyproject.toml) by the names they are imported under
RUNTIME_MODULES = (
    "torch",
    "ray",
    "transformers",
    "peft",
    "fastapi",
    "uvicorn",
    "redis",
    "prometheus_client",
    "safetensors",
    "tokenizers",
    "tinker",
)

_BLOCKING_MAIN = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = set(sys.argv[1].split(","))

    class RefuseRuntime(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: a login node)", name=name)
            return None

    sys.meta_path.insert(0, RefuseRuntime())
    from launcher.cli import main

    main(sys.argv[2:], prog_name="launcher")
    """
)


def launcher_without_runtime(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_DEAD_PROBES"}
    env |= {"MILES_RUNS_DIR": str(tmp_path / "runs"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    return subprocess.run(
        [sys.executable, "-c", _BLOCKING_MAIN, ",".join(RUNTIME_MODULES), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


def test_the_blocker_refuses_the_runtime(tmp_path: Path) -> None:
    # the harness itself: an import of a blocked package fails there (else the tests below prove nothing)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _BLOCKING_MAIN.replace("from launcher.cli", "import ray\nfrom launcher.cli"),
            "ray",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "blocked: a login node" in proc.stderr


def test_presets_list_and_render_without_the_runtime(tmp_path: Path) -> None:
    listed = launcher_without_runtime("presets", "list", "--json", tmp_path=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "tiny-cpu" in listed.stdout

    rendered = launcher_without_runtime(
        "render", "--preset", "tiny-cpu", "--scheduler", "slurm", tmp_path=tmp_path
    )
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith("#!") and "#SBATCH" in rendered.stdout


def test_submit_dry_run_checks_model_and_engine_flags_without_the_runtime(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    # a pretrained model directory and a CPU engine flag: the two submit checks that reach into miles/
    submitted = launcher_without_runtime(
        "submit", "--preset", "tiny-cpu", "--dry-run", "--json",
        "--set", "model.init=pretrained", "--set", f"model.path={model_dir}",
        "--set", "engines.server_args.served_model_name=tiny",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    data = json.loads(submitted.stdout)
    assert Path(data["script"]).is_file()

    # a hub name not in the cache: found missing by huggingface_hub's offline lookup, with the fix, not an
    # ImportError; and an SGLang-only flag is refused by the CPU engine's own parser (a dry run warns)
    warned = launcher_without_runtime(
        "submit", "--preset", "tiny-cpu", "--dry-run",
        "--set", "model.init=pretrained", "--set", "model.path=NoOrg/not-cached",
        "--set", "engines.server_args.mem_fraction_static=0.8",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert warned.returncode == 0, warned.stderr
    output = warned.stdout + warned.stderr
    assert "blocked" not in output and "Traceback" not in output
    assert "huggingface-cli download NoOrg/not-cached" in output
    assert "does not take --mem-fraction-static" in output
