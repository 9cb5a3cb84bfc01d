"""System tests: the real local Slurm cluster (../shared/slurm-local), the real OpenPBS cluster
(../shared/pbs-local), real jobs, real Ray.

Every test here skips with a reason when its cluster is not up (SLURM_CONF unset, no PBS_EXEC in
/etc/pbs.conf) or does not answer.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from jobtools import slurm_unavailable
from pbstools import pbs_tool, pbs_unavailable


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.system)


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def pbs_cluster() -> None:
    reason = pbs_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def pbs_jobs() -> Iterator[list[str]]:
    """PBS job ids a test submitted: deleted at the end whatever happened."""
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run([pbs_tool("qdel"), "-W", "force", *jobs], capture_output=True, timeout=30)


@pytest.fixture
def runs_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the Slurm "nodes" share this host's file system, so a pytest temp dir is a shared run dir
    base = tmp_path_factory.mktemp("runs")
    monkeypatch.setenv("MILES_RUNS_DIR", str(base))
    monkeypatch.delenv("GATEWAY_DEAD_PROBES", raising=False)
    return base


@pytest.fixture
def write_preset(tmp_path: Path) -> Callable[[dict], Path]:
    def write(data: dict) -> Path:
        path = tmp_path / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write


@pytest.fixture
def slurm_jobs() -> Iterator[list[str]]:
    """Job ids a test submitted: cancelled at the end whatever happened."""
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
