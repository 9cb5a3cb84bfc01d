"""The training-maths tests of tests/fast/train/test_backend_maths.py, re-run on CUDA in fp32 and bf16.

The fast module is loaded by path and its tests re-exported here; only the `env` fixture changes. bf16
tolerances are loose: the reference runs in bf16 too, but padding and micro-batching change the order
of bf16 accumulations.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

_FAST = Path(__file__).resolve().parents[1] / "fast" / "train" / "test_backend_maths.py"
_spec = importlib.util.spec_from_file_location("miles_fast_backend_maths", _FAST)
assert _spec is not None and _spec.loader is not None
_maths = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _maths  # dataclasses look their module up there
_spec.loader.exec_module(_maths)

pytestmark = pytest.mark.gpu
TrainEnv = _maths.TrainEnv
ref_model = _maths.ref_model
globals().update({name: value for name, value in vars(_maths).items() if name.startswith("test_")})


@pytest.fixture(
    scope="module",
    params=[
        TrainEnv("cuda", torch.float32, 2e-4, 2e-4),
        TrainEnv("cuda", torch.bfloat16, 5e-2, 5e-2),
    ],
    ids=["fp32", "bf16"],
)
def env(request: pytest.FixtureRequest) -> TrainEnv:
    return request.param
