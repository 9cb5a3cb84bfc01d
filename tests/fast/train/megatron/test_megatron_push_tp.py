"""The weight push at TP 2 on CPU: two gloo ranks holding megatron-core's real GPT in TP shards run the
sender's commands (rank 0 sends, rank 1 gathers), and a receiver in this process, in the weight-update group
as an engine would be, gets every HF tensor equal to the checkpoint's (the TP 1 export, exactly: see
test_megatron_model_cpu.py). Buckets are small, so some cut a fused QKV or fc1 tensor between two of them.
At pipeline 2 (one layer per stage) rank 1 holds the second stage and sends its tensors to rank 0 for the
buckets that name them. Both layouts run on the same two processes, one after the other (a process costs
seconds of imports on CI's two cores). Skips without the gpu extra."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="megatron-core is the gpu extra")

from miles.engines.weight_group import create_weight_update_group, pick_master_port
from miles.train.megatron.push import push_role
from miles.utils.buckets import plan_buckets, unpack_flat
from tests.fast.train.megatron.ranks import join_gloo, running

BUCKET_BYTES = 24 * 1024  # the tiny model's QKV is 32 KiB in fp32: some buckets cut it


class _Backend:
    """What the sender asks of a megatron backend: its push source."""

    def __init__(self, gpt: torch.nn.Module, shape: Any, pipelined: bool) -> None:
        self.gpt, self.shape, self.pipelined = gpt, shape, pipelined

    def push_source(self) -> Any:
        from miles.train.megatron.pipeline_weights import PipelinePushSource
        from miles.train.megatron.push import TpPushSource

        return (PipelinePushSource if self.pipelined else TpPushSource)(self.gpt, self.shape)


def _load(layout: Any, model_dir: str, shape: Any) -> torch.nn.Module:
    from miles.train.megatron import model as mcore
    from miles.train.megatron import pipeline

    if layout.pipeline > 1:
        gpt = pipeline.build_stage_gpt(shape, layout, torch.float32)
        pipeline.load_stage_weights(gpt, model_dir, shape)
        return gpt
    gpt = mcore.build_gpt(shape, layout, torch.float32)
    mcore.load_hf_weights(gpt, model_dir, shape)
    return gpt


LAYOUTS = {"tp2": {"tensor": 2}, "pp2": {"pipeline": 2}}  # one after the other on the same two processes


def _trainer_rank(rank: int, port: int, model_dir: str, queue: Any, results: Any) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles.contract.preset.model import ParallelLayout
    from miles.contract.shape import ModelShape
    from miles.train.megatron import model as mcore
    from miles.weights.sender import Broadcast, Close, Describe, GroupSpec, Join

    try:
        join_gloo(rank, 2, port, timeout_s=60)
        shape = ModelShape.from_model_dir(model_dir)
        for name, parallel in LAYOUTS.items():
            parallel_state.destroy_model_parallel()  # the previous layout's groups
            layout = ParallelLayout(**parallel)
            mcore.init_parallel(layout, seed=0)
            backend = _Backend(_load(layout, model_dir, shape), shape, layout.pipeline > 1)
            info = Describe().run(backend)
            plan: list[Any] = [None]
            group_name = f"push-test-{name}"
            if rank == 0:
                plan[0] = plan_buckets(info.tensors, BUCKET_BYTES, flattened=True)
                spec = GroupSpec(info.master_address, info.master_port, 2, group_name, timeout_s=60)
                queue.put((spec, plan[0]))
            dist.broadcast_object_list(plan, src=0)  # the driver's plan, given to every rank by Join
            names = tuple(tuple(m.name for m in bucket) for bucket in plan[0])
            spec = GroupSpec("127.0.0.1", 0, 2, group_name) if rank else spec
            joined = Join(spec, names, flattened=True).run(backend)
            sent = [Broadcast(spec.group_name, k).run(backend) for k in range(len(names))]
            Close(spec.group_name).run(backend)
            got = {"info": info is not None, "joined": joined, "sent": [s is not None for s in sent]}
            got["delta"] = _delta_pushes(rank, backend, spec, names, queue, plan[0])
            results.put(((name, rank), got))
    except BaseException as exc:
        results.put((("error", rank), {"error": repr(exc)}))
        raise


def _delta_pushes(rank: int, backend: Any, spec: Any, names: Any, queue: Any, plan: Any) -> dict[str, Any]:
    """Over one kept group: a recording push, a change of every rank's shards, a delta push (and the
    digests of the trainer's image), then a plain full push of the same weights to compare with."""
    from dataclasses import replace

    from miles.weights.sender import Broadcast, Close, DigestImage, Join

    spec = replace(spec, group_name=f"{spec.group_name}-delta")
    if rank == 0:
        queue.put((spec, plan))
    out: dict[str, Any] = {}
    for mode in ("record", "send", "off"):
        if mode == "send":
            with torch.no_grad():
                for param in backend.gpt.parameters():
                    param.view(-1)[rank::7] += 0.01  # every rank changes its own shards
        Join(spec, names, flattened=True, reuse=mode != "record", delta=mode).run(backend)
        sent = [Broadcast(spec.group_name, k).run(backend) for k in range(len(names))]
        if mode == "send":
            out["forms"] = sorted({s.form for s in sent if s is not None})
            out["digests"] = DigestImage(spec.group_name).run(backend)
        Close(spec.group_name, keep=mode != "off").run(backend)
    return out


def _join_as_engine(spec: Any) -> Any:
    """The weight-update group as an engine joins it: rank 1 of 2, over gloo."""
    return create_weight_update_group(
        master_address=spec.master_address,
        master_port=spec.master_port,
        rank=1,
        world_size=2,
        backend="gloo",
        group_name=spec.group_name,
        timeout_s=60,
    )


def _receive_deltas(spec: Any, plan: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An engine through the three pushes of `_delta_pushes`: (its buckets after the delta push, the
    buckets the full push after it sent)."""
    from miles.utils import delta

    group = _join_as_engine(spec)
    held = [torch.empty(sum(m.nbytes for m in bucket), dtype=torch.uint8) for bucket in plan]
    for buffer in held:
        group.broadcast(buffer, src=0)
    for buffer in held:
        header = torch.empty(delta.HEADER_WORDS, dtype=torch.int64)
        group.broadcast(header, src=0)
        payload = torch.empty(delta.payload_nbytes(header), dtype=torch.uint8)
        group.broadcast(payload, src=0)
        delta.apply_bucket(buffer, header, payload)
    full = [torch.empty_like(buffer) for buffer in held]
    for buffer in full:
        group.broadcast(buffer, src=0)
    group.destroy()
    return held, full


def _receive(spec: Any, plan: list[Any]) -> dict[str, torch.Tensor]:
    """What an engine in the weight-update group receives: every bucket, unpacked."""
    group = _join_as_engine(spec)
    received: dict[str, torch.Tensor] = {}
    for bucket in plan:
        buffer = torch.empty(sum(m.nbytes for m in bucket), dtype=torch.uint8)
        group.broadcast(buffer, src=0)
        received.update((m.name, t.clone()) for m, t in zip(bucket, unpack_flat(buffer, bucket), strict=True))
    group.destroy()
    return received


@pytest.fixture(scope="module")
def pushes(tiny_model_dir: Path) -> dict[str, Any]:
    """Per layout: (the plan, the tensors received, each rank's answers)."""
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    port = pick_master_port("127.0.0.1")
    ranks = [
        ctx.Process(target=_trainer_rank, args=(r, port, str(tiny_model_dir), queue, results)) for r in (0, 1)
    ]
    with running(ranks):
        received, deltas = {}, {}
        for name in LAYOUTS:
            spec, plan = queue.get(timeout=120)
            received[name] = (plan, _receive(spec, plan))
            spec, plan = queue.get(timeout=120)
            deltas[name] = _receive_deltas(spec, plan)
        outcome = dict(results.get(timeout=60) for _ in range(len(ranks) * len(LAYOUTS)))
    assert all("error" not in r for r in outcome.values()), outcome
    return {
        name: (*received[name], {r: outcome[(name, r)] for r in (0, 1)}, deltas[name]) for name in LAYOUTS
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_push_delivers_the_checkpoints_hf_tensors(
    tiny_model_dir: Path, pushes: dict, layout: str
) -> None:
    plan, received, outcome, _ = pushes[layout]
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    assert received.keys() == hf.keys()
    assert all(torch.equal(received[name], hf[name]) for name in hf)
    last_of_each = [bucket[-1].name for bucket in plan[:-1]]
    assert any(n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for n in last_of_each)
    # rank 0 describes and broadcasts; rank 1 only gathers (no engine group, nothing sent)
    assert outcome[0]["info"] and not outcome[1]["info"]
    assert all(outcome[0]["sent"]) and not any(outcome[1]["sent"])
    assert outcome[0]["joined"] == outcome[1]["joined"] == len(hf)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_delta_push_of_gathered_buckets_equals_the_full_push_after_it(pushes: dict, layout: str) -> None:
    """Issue 36 on the megatron path: the sender diffs the gathered, packed buckets against its image; the
    engine's buckets after applying the deltas are byte for byte what a full push then sends, and the
    trainer's image digests are the engine's."""
    from miles.utils import delta

    plan, _, outcome, (held, full) = pushes[layout]
    assert all(torch.equal(h, f) for h, f in zip(held, full, strict=True))
    assert outcome[0]["delta"]["forms"] and "full" not in outcome[0]["delta"]["forms"]
    assert outcome[1]["delta"] == {"forms": [], "digests": None}, "a gatherer sends nothing, holds no image"
    named = [
        (meta.name, tensor)
        for bucket, buffer in zip(plan, held, strict=True)
        for meta, tensor in zip(bucket, unpack_flat(buffer, bucket), strict=True)
    ]
    assert outcome[0]["delta"]["digests"] == delta.digest_many(named)


def test_only_the_first_data_parallel_replica_takes_part_in_the_push() -> None:
    assert push_role(tp_rank=0, dp_rank=0) == "sender"
    assert push_role(tp_rank=1, dp_rank=0) == "gatherer"
    assert push_role(tp_rank=0, dp_rank=1) == push_role(tp_rank=3, dp_rank=2) == "idle"
