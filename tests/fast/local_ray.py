"""One local Ray cluster for a test module: logical GPUs, single-threaded workers, its own temp dir."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import ray

WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Ray puts its sockets at <temp dir>/session_<date>_<pid>/sockets/plasma_store (~64 more characters), and a
# Unix socket path holds 107 bytes: pytest's numbered temp dirs pass that once the count has 4 digits.
MAX_TEMP_DIR_LEN = 40


def _short(temp_dir: Path) -> Path:
    """`temp_dir`, or a short directory under /tmp (removed at exit) when Ray's socket paths would not fit."""
    if len(str(temp_dir)) <= MAX_TEMP_DIR_LEN:
        return temp_dir
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    atexit.register(shutil.rmtree, short, True)
    return Path(short)


def init_local_ray(temp_dir: Path, *, num_cpus: int, num_gpus: int) -> None:
    """`ray.init` on this machine; GPUs are logical (placement only: the tests run on CPU)."""
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=str(_short(temp_dir)),
        runtime_env={"env_vars": WORKER_ENV},
    )
