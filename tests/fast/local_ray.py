"""One local Ray cluster for a test module: logical GPUs, single-threaded workers, its own temp dir."""

from __future__ import annotations

from pathlib import Path

import ray

WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def init_local_ray(temp_dir: Path, *, num_cpus: int, num_gpus: int) -> None:
    """`ray.init` on this machine; GPUs are logical (placement only: the tests run on CPU)."""
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        runtime_env={"env_vars": WORKER_ENV},
    )
