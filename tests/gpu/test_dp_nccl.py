"""Data parallel over NCCL, one rank per GPU: one step of two ranks equals one rank's step on the same data
(the gloo claim of tests/fast/train/test_cells_on_ray.py, on GPUs): the gradients the optimizer steps with,
the parameters after the step, the loss and the logprobs. bench/train_dp.py's check phase does the work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from train_dp import Config, run_ranks
from train_throughput import TINY, Setup, write_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "dtype, grad_rel, param_abs, logprob_abs",
    [("float32", 1e-4, 1e-6, 1e-4), ("bfloat16", 5e-2, 1e-2, 5e-2)],
)
def test_two_nccl_ranks_step_like_one(
    tmp_path: Path, dtype: str, grad_rel: float, param_abs: float, logprob_abs: float
) -> None:
    write_model(tmp_path, TINY, Setup("cpu", getattr(torch, dtype), 1, 1, 0))
    config = Config(
        ranks=2, device="cuda", dtype=dtype, batch=2, seq_len=64, check_seq_len=48, warmup=0, steps=1,
        lr=1e-5, chunk_tokens=16,
    )  # fmt: skip
    check = run_ranks(tmp_path, config, ["check"], timeout_s=300)["check"]
    assert check.tensors > 0
    assert check.grad_rel_max < grad_rel
    assert check.param_abs_max < param_abs
    assert check.logprob_abs_max < logprob_abs
    assert check.grad_norm_dp == pytest.approx(check.grad_norm_single, rel=grad_rel)
    assert check.loss_dp == pytest.approx(check.loss_single, rel=grad_rel)
