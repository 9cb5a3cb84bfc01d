"""The context-parallel attention (`attend_context_parallel`, miles.train.megatron.context) against plain
causal SDPA on the whole sequence in one process: CP ranks (gloo processes) each hold their two chunks of
Q, K and V, attend with the gathered K and V, and back-propagate a loss over their own outputs (CP 2 and 3
on one set of three processes, CP 2 on a subgroup). Each rank's outputs and the gradients of its Q, K and V
(K and V's reduce-scattered from every rank's queries) must equal the single-process ones at its positions,
in float64, with grouped-query heads. Also: the chunk layout is megatron's RoPE layout (that test alone needs
megatron-core; the others run in CI)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from miles.engines.weight_group import pick_master_port
from miles.train.megatron.context import ContextSplit, local_positions, sequence_order
from tests.fast.train.megatron.ranks import join_gloo, running

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def _inputs(width: int) -> tuple[torch.Tensor, ...]:
    """q [b, heads, W, d], k and v [b, kv_heads, W, d], and the loss weights on the outputs, all float64."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, width, DIM, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(BATCH, KV_HEADS, width, DIM, generator=generator, dtype=torch.float64) for _ in "kv")
    weights = torch.randn(BATCH, HEADS, width, DIM, generator=generator, dtype=torch.float64)
    return q, k, v, weights


def reference(width: int) -> dict[str, torch.Tensor]:
    q, k, v, weights = _inputs(width)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * weights).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


CASES = ((2, 12), (3, 18))  # (CP size, width): both on one set of gloo processes, CP 2 on a subgroup
WORLD = max(size for size, _ in CASES)


def _rank(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    from miles.train.megatron.context import attend_context_parallel

    try:
        join_gloo(rank, WORLD, port, timeout_s=60)
        for size, width in CASES:
            group = dist.new_group(list(range(size)))  # every rank creates every group
            if rank >= size:
                continue
            split = ContextSplit(size, rank, group)
            q, k, v, weights = (split.local(t, dim=2) for t in _inputs(width))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            out = attend_context_parallel(q, k, v, None, split)
            (out * weights).sum().backward()
            got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
            results.put(((size, rank), {n: t.numpy() for n, t in got.items()}))  # not as shared memory
    except BaseException as exc:
        results.put(((0, rank), {"error": repr(exc)}))
        raise


@pytest.fixture(scope="module")
def outcome() -> dict[tuple[int, int], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = pick_master_port("127.0.0.1")
    ranks = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(WORLD)]
    with running(ranks):
        got = {}
        for _ in range(sum(size for size, _ in CASES)):
            key, value = results.get(timeout=120)
            got[key] = value
            assert "error" not in value, got
    return got


@pytest.mark.parametrize(("size", "width"), CASES)
def test_gathered_attention_and_its_backward_equal_whole_sequence_attention(
    outcome: dict[tuple[int, int], dict[str, Any]], size: int, width: int
) -> None:
    want = reference(width)
    for rank in range(size):
        got = outcome[(size, rank)]
        mine = local_positions(width, size, rank)
        for name in ("out", "q", "k", "v"):
            expected = want[name].index_select(2, mine)
            torch.testing.assert_close(
                torch.from_numpy(got[name]), expected, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}"
            )


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_as_megatrons_rope_slices_them() -> None:
    rope_utils = pytest.importorskip(
        "megatron.core.models.common.embeddings.rope_utils", reason="megatron-core is the gpu extra"
    )

    table = torch.arange(16.0).unsqueeze(-1)  # the rotary table's rows are positions
    for rank in range(4):
        group = type("Group", (), {"size": lambda self: 4, "rank": lambda self, r=rank: r})()
        with _cpu_index():
            theirs = rope_utils.get_pos_emb_on_this_cp_rank(table, 0, group).flatten()
        assert local_positions(16, 4, rank).tolist() == theirs.long().tolist()
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    gathered = torch.cat([local_positions(8, 2, r) for r in range(2)])
    assert gathered[sequence_order(8, 2)].tolist() == list(range(8))


def _cpu_index():
    """megatron builds the chunk index in pinned memory and moves it to CUDA: here it stays on the CPU."""
    import contextlib
    from unittest import mock

    real = torch.tensor

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return real(*args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("torch.tensor", tensor))
    stack.enter_context(mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self))
    return stack
