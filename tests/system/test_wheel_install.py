"""A wheel install of the launcher, as on a login node: the sdist and the wheel built from a copy of the
repository, installed into a fresh venv (no system site-packages, no runtime extra), then the commands a
researcher runs first. The templates and presets must come from the installed package, not a checkout.

Slow (about 30 s: a venv and the launcher's core dependencies from the package index; pip's cache makes
reruns quicker).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# what an sdist of the project holds (MANIFEST.in adds templates/ and presets/)
SOURCE_ENTRIES = (
    "pyproject.toml",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "launcher",
    "miles",
    "templates",
    "presets",
)
RUNTIME_ONLY = {"torch", "ray", "transformers", "peft", "fastapi", "uvicorn", "redis"}


def _run(argv: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build_wheel(work: Path) -> Path:
    """sdist first, then the wheel from the sdist in an isolated build environment (as `python -m build`
    does), from a copy: the shared tree gets no build/ directory."""
    source = work / "src"
    for name in SOURCE_ENTRIES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    build_sdist = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    sdist = source / "dist" / _run([sys.executable, "-c", build_sdist], cwd=source).strip().splitlines()[-1]
    wheels = work / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels, sdist],
        cwd=work,
    )
    (wheel,) = wheels.glob("miles_hpc-*.whl")
    return wheel


def _requirements(wheel: Path) -> tuple[set[str], set[str]]:
    """The wheel's own requirement names: (always, only with the `runtime` extra)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    core, runtime = set(), set()
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None:
            core.add(requirement.name.lower())
        elif requirement.marker.evaluate({"extra": "runtime"}):
            runtime.add(requirement.name.lower())
    return core, runtime


def _shipped_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_wheel_installs_the_launcher_without_the_runtime(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)

    core, runtime = _requirements(wheel)
    assert core & RUNTIME_ONLY == set(), "pip install miles-hpc must not pull the runtime"
    assert runtime >= RUNTIME_ONLY
    with zipfile.ZipFile(wheel) as archive:
        packaged = set(archive.namelist())
    for name in ("templates", "presets"):
        expected = {f"launcher/{name}/{path}" for path in _shipped_files(REPO / name)}
        assert expected and expected <= packaged, f"{name}/ is missing from the wheel: {expected - packaged}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], cwd=tmp_path)

    away = tmp_path / "elsewhere"  # no checkout in sight: a cwd with no templates/ or presets/
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_DEAD_PROBES", "PYTHONPATH")}
    env["MILES_RUNS_DIR"] = str(away / "runs")
    python = venv / "bin" / "python"
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=away)
    assert no_torch.returncode != 0, "the runtime leaked into a launcher-only install"
    where = _run(
        [python, "-c", "from launcher.shipped import shipped_dir; print(shipped_dir('templates'))"], away
    )
    assert Path(where.strip()).is_relative_to(venv), where

    launcher = venv / "bin" / "launcher"
    listed = json.loads(_run([launcher, "presets", "list", "--json"], away, env))
    assert {p.stem for p in (REPO / "presets").glob("*.yaml")} <= {preset["name"] for preset in listed}
    script = _run([launcher, "render", "--preset", "tiny-cpu", "--scheduler", "pbs"], away, env)
    assert "#PBS -l walltime=" in script
    submitted = json.loads(
        _run([launcher, "submit", "--preset", "tiny-cpu", "--dry-run", "--json"], away, env)
    )
    assert Path(submitted["script"]).is_file() and Path(submitted["run_dir"]).is_relative_to(away / "runs")
