"""The full-weight push over NCCL between two GPUs: a trainer process on one, the CPU engine's Engine on
CUDA on the other, in one weight-update group, through the real push driver and weight sender (no Ray, no
HTTP: bench/push_nccl.py's harness, run as a subprocess so each process sees only its own GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[2] / "bench" / "push_nccl.py"


def _push(*args: str) -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--repeats", "1", "--watchdog-s", "150", *args],
        capture_output=True, text=True, timeout=400, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_nccl_push_gives_the_engine_the_trainers_weights(dtype: str, tolerance: float) -> None:
    report = _push("--model", "tiny", "--dtype", dtype, "--bucket-mib", "0.25,0.0625")
    check = report["check"]
    assert report["device"].startswith("cuda")
    assert check["tensors_equal"] == check["tensors"] > 0  # every tensor arrived bit for bit
    assert check["max_diff_before"] > 0.2, "the trainer's step should have moved its logprobs"
    assert check["max_diff_after"] < tolerance
    for run in report["runs"]:
        assert run["buckets"] > 1 and run["bytes"] == report["model_bytes"]
