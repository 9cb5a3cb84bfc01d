"""bench/push_nccl.py's harness on CPU (gloo): the real push driver and weight sender between a trainer
process and an in-process engine, without Ray or HTTP. The same code runs over NCCL on two GPUs
(tests/gpu/test_push_nccl.py); here it must move every byte and leave the engine with the trainer's model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import push_nccl


@pytest.mark.timeout(180)
def test_push_bench_moves_every_byte_and_the_engine_gets_the_trainers_logprobs(monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    report = push_nccl.main(["--small", "--repeats", "1", "--bucket-mib", "0.0625"])
    check = report.check
    assert check.tensors_equal == check.tensors > 0
    assert check.max_diff_before > 1e-2, "the trainer's step should have moved its logprobs"
    assert check.max_diff_after < 1e-4
    [run] = report.runs
    assert run.buckets > 1 and run.bytes == report.model_bytes > 0
    assert 0 < run.transfer_s <= run.push_s
    assert run.raw_s > 0 and run.pack_s > 0 and run.unpack_load_s > 0
