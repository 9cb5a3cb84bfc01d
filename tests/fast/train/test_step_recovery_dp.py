"""Data parallel: when one rank runs out of memory, every rank fails the call together and nobody hangs.

Two processes form a real gloo group (as trainer ranks do) and train the full tiny model. Only rank 1's
backward hits a real allocator failure; rank 0's share computes fine. Both ranks raise the same user error
(rank 0 learns it from the failure all-reduce, before it would wait in the output gather), both keep their
state bit for bit, and the next step on both ranks matches a single-rank run without the failed request.
The same for an optim_step whose all-reduce buffer rank 1 cannot allocate: both ranks fail it before the
all-reduce (optim_guard), and nothing changes. And the same for a UserError raised on rank 1's share only
(a custom loss's guard at a datum the whole-batch preflight did not run): both ranks raise rank 1's message.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist

from miles.contract.ports import claim_port
from miles.errors import UserError
from miles.train.backends import transformers_backend as backend_module
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.dist import DistContext
from tests.fast.train.test_optim_step_recovery import allocation_failure_in
from tests.fast.train.test_step_recovery import (
    ADAM,
    allocation_failure_in_backward,
    assert_same,
    batch,
    state_of,
)

pytestmark = pytest.mark.slow

FIRST, SECOND, OVERSIZED = batch(1, (6, 8)), batch(2, (7, 5)), batch(3, (9, 9, 9, 9))


def rank_main(rank: int, port: int, model_dir: str, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        backend = TransformersBackend(
            model_dir, train_mode="full", dist=DistContext(rank, 2), max_tokens_per_micro_batch=16
        )
        backend.forward_backward("m", FIRST, "cross_entropy", {})
        backend.optim_step("m", ADAM)
        backend.forward_backward("m", SECOND, "cross_entropy", {})
        before = state_of(backend, "m")
        hooked = backend.named_trainable_parameters("m")[0][1]
        on_call = 2 if rank == 1 else 10**9  # rank 1's share (datums 2-3) is two micro-batches
        message = ""
        with allocation_failure_in_backward(hooked, on_call):
            try:
                backend.forward_backward("m", OVERSIZED, "cross_entropy", {})
            except UserError as exc:
                message = str(exc)
        unchanged = same_state(backend, before)
        # optim_step: rank 1 runs out of memory making the all-reduce buffer, before any collective
        step_message = ""
        with allocation_failure_in("new_flat_buffer", 1 if rank == 1 else 10**9):
            try:
                backend.optim_step("m", ADAM)
            except UserError as exc:
                step_message = str(exc)
        unchanged = unchanged and same_state(backend, before)
        backend.forward_backward("m", FIRST, "cross_entropy", {})
        backend.optim_step("m", ADAM)
        params = {n: p.detach().numpy().copy() for n, p in backend.named_trainable_parameters("m")}
        results.put((rank, (message, step_message), unchanged, params))
    finally:
        torch_dist.destroy_process_group()


def same_state(backend: TransformersBackend, before: dict) -> bool:
    try:
        assert_same(state_of(backend, "m"), before)
    except AssertionError:
        return False
    return True


def run_two_ranks(target, model_dir: Path) -> dict[int, tuple]:
    """`target(rank, port, model_dir, results)` on two spawned ranks; per rank what it put."""
    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    port = claim_port("MASTER_PORT")  # bound by a rank the spawn starts seconds later
    procs = [context.Process(target=target, args=(rank, port, str(model_dir), results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        outcome = {}
        for _ in procs:
            rank, *rest = results.get(timeout=240)
            outcome[rank] = tuple(rest)
    except queue.Empty:
        pytest.fail("a rank never finished: hung in a collective?")
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return outcome


def refusing_rank_main(rank: int, port: int, model_dir: str, results: mp.Queue) -> None:
    """Rank 1's share of the second call raises a UserError, as a custom loss's guard does."""
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        backend = TransformersBackend(model_dir, train_mode="full", dist=DistContext(rank, 2))
        backend.forward_backward("m", FIRST, "cross_entropy", {})
        before = state_of(backend, "m")
        real_run = backend_module.run_datums

        def refuse_on_rank_1(model, data, *args, **kwargs):
            if rank == 1:
                raise UserError("datum 3: the custom loss made a tensor of 2**40 elements")
            return real_run(model, data, *args, **kwargs)

        backend_module.run_datums = refuse_on_rank_1
        try:
            backend.forward_backward("m", OVERSIZED, "cross_entropy", {})
            message = ""
        except UserError as exc:
            message = str(exc)
        finally:
            backend_module.run_datums = real_run
        unchanged = same_state(backend, before)
        backend.optim_step("m", ADAM)  # the next collective works: no rank was left behind
        params = {n: p.detach().numpy().copy() for n, p in backend.named_trainable_parameters("m")}
        results.put((rank, message, unchanged, params))
    finally:
        torch_dist.destroy_process_group()


def test_a_refusal_on_one_rank_is_raised_on_every_rank_without_a_hang(tiny_model_dir: Path) -> None:
    outcome = run_two_ranks(refusing_rank_main, tiny_model_dir)
    for rank in (0, 1):
        message, unchanged, _ = outcome[rank]
        assert message == "datum 3: the custom loss made a tensor of 2**40 elements", (rank, message)
        assert unchanged, f"rank {rank} kept part of the refused call"
    for name, param in outcome[0][2].items():
        np.testing.assert_array_equal(param, outcome[1][2][name])


def test_one_rank_out_of_memory_fails_the_call_on_every_rank_without_a_hang(tiny_model_dir: Path) -> None:
    outcome = run_two_ranks(rank_main, tiny_model_dir)

    (fb_own, step_own), (fb_other, step_other) = outcome[1][0], outcome[0][0]
    assert "ran out of device memory on a batch of 4 datums, 36 tokens" in fb_own
    assert "can't allocate memory" in fb_own
    assert "(another data-parallel rank)" in fb_other
    assert "optim_step ran out of device memory" in step_own and "can't allocate memory" in step_own
    assert "optim_step ran out of device memory" in step_other and "another data-parallel rank" in step_other
    assert outcome[0][1] and outcome[1][1], "a rank's parameters, gradients or optimizer state changed"

    single = TransformersBackend(str(tiny_model_dir), train_mode="full", max_tokens_per_micro_batch=16)
    for data in (FIRST, SECOND):
        single.forward_backward("m", data, "cross_entropy", {})
        if data is FIRST:
            single.optim_step("m", ADAM)
    single.forward_backward("m", FIRST, "cross_entropy", {})
    single.optim_step("m", ADAM)
    for name, param in single.named_trainable_parameters("m"):
        want = param.detach().numpy()
        for rank in (0, 1):
            np.testing.assert_allclose(outcome[rank][2][name], want, atol=1e-5, rtol=1e-5, err_msg=name)
        np.testing.assert_array_equal(outcome[0][2][name], outcome[1][2][name])
