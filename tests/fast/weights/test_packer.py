"""The trainer's double-buffered bucket packing, and the sender steps around it on a real gloo group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from miles.utils.buckets import TensorMeta, pack_flat, plan_buckets
from miles.utils.packer import BucketPacker
from miles.weights.sender import Broadcast, Close, GroupFailure, GroupSpec, Join, SentBucket, open_sessions


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(7):
        dtype = [torch.float32, torch.bfloat16, torch.float16][i % 3]
        out[f"layer.{i}.weight"] = torch.randn(3 + i, 5, generator=gen).to(dtype)
    out["odd.bias"] = torch.randn(3, generator=gen).to(torch.bfloat16)  # 6 bytes: the next fp32 must move
    out["last.weight"] = torch.randn(4, 4, generator=gen).t()  # not contiguous
    return out


def plan_of(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    return [[m.name for m in b] for b in plan_buckets(metas, bucket_bytes, flattened=True)]


def test_every_bucket_is_packed_as_pack_flat_packs_it_in_two_reused_buffers() -> None:
    tensors = weights()
    plan = plan_of(tensors, 200)
    assert len(plan) >= 4
    packer = BucketPacker(tensors, plan, torch.device("cpu"))
    try:
        pointers = []
        for index, names in enumerate(plan):
            chosen = [tensors[n] for n in names]
            expected = pack_flat(chosen, [TensorMeta.of(n, t) for n, t in zip(names, chosen, strict=True)])
            got = packer.take(index)
            assert torch.equal(got, expected), f"bucket {index}"
            if len(names) > 1 or not chosen[0].is_contiguous():  # not one piece of memory: packed
                pointers.append(got.data_ptr())
            else:  # a single contiguous tensor is sent as it lies
                assert got.data_ptr() == chosen[0].data_ptr()
            packer.sent(index)
        assert packer.packed_buckets == len(pointers) >= 4
        assert pointers[0] == pointers[2] != pointers[1] == pointers[3]  # two buffers, taken in turn
    finally:
        packer.close()


def test_weights_laid_out_back_to_back_are_sent_as_they_lie() -> None:
    from miles.utils.memory import lay_out_back_to_back

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4, bias=False))
    assert lay_out_back_to_back(model) == 1
    tensors = {name: p.data for name, p in model.named_parameters()}
    plan = plan_of(tensors, 1 << 20)
    assert len(plan) == 1
    packer = BucketPacker(tensors, plan, torch.device("cpu"))
    try:
        got = packer.take(0)
        assert packer.packed_buckets == 0
        assert got.data_ptr() == tensors["0.weight"].data_ptr()  # a view of the weights, not a copy
        assert torch.equal(
            got, pack_flat(list(tensors.values()), [TensorMeta.of(n, t) for n, t in tensors.items()])
        )
    finally:
        packer.close()


def test_the_next_bucket_is_packing_while_this_one_is_sent() -> None:
    tensors = weights()
    plan = plan_of(tensors, 200)
    packer = BucketPacker(tensors, plan, torch.device("cpu"))
    try:
        packer.take(0)
        assert 1 in packer._pending  # started by take(0), before bucket 0's broadcast
        with pytest.raises(RuntimeError, match="plan order"):
            packer.take(2)
    finally:
        packer.close()


def test_a_misaligned_plan_is_refused() -> None:
    tensors = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float32)}
    with pytest.raises(ValueError, match="not a multiple of its itemsize"):
        BucketPacker(tensors, [["a", "b"]], torch.device("cpu"))


class WeightsOnly:
    """The one backend method the sender reads."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def group(name: str) -> GroupSpec:
    from miles.engines.weight_group import pick_master_port

    return GroupSpec("127.0.0.1", pick_master_port("127.0.0.1"), world_size=1, group_name=name, timeout_s=30)


@pytest.mark.parametrize("flattened", [True, False])
def test_sender_sends_the_plan_in_order_and_refuses_a_skip(flattened: bool) -> None:
    tensors = weights()
    plan = tuple(tuple(b) for b in plan_of(tensors, 200))
    backend = WeightsOnly(tensors)
    spec = group(f"packer-test-{flattened}")
    assert Join(spec, plan, flattened).run(backend) == len(tensors)
    try:
        sent = Broadcast(spec.group_name, 0).run(backend)
        assert isinstance(sent, SentBucket)
        assert sent.bytes == sum(tensors[n].numel() * tensors[n].element_size() for n in plan[0])
        skipped = Broadcast(spec.group_name, 2).run(backend)
        assert isinstance(skipped, GroupFailure) and "buckets go in order" in skipped.message
        assert spec.group_name not in open_sessions()  # a refused bucket ends the session
    finally:
        Close(spec.group_name).run(backend)


def test_a_plan_naming_unknown_tensors_is_refused_before_joining() -> None:
    backend = WeightsOnly(weights())
    spec = group("packer-test-unknown")
    with pytest.raises(ValueError, match="does not have"):
        Join(spec, (("layer.0.weight", "nope"),)).run(backend)
    assert spec.group_name not in open_sessions()


def test_a_tied_weight_is_described_and_sent_once() -> None:
    from miles.weights.sender import Describe

    tensors = weights()
    tensors["lm_head.weight"] = tensors["layer.0.weight"]  # tied: the same memory under a second name
    backend = WeightsOnly(tensors)
    names = [m.name for m in Describe().run(backend).tensors]
    assert "lm_head.weight" not in names and names.count("layer.0.weight") == 1
    assert len(names) == len(tensors) - 1


def test_a_kept_group_serves_the_next_join_and_a_fresh_join_leaves_it() -> None:
    from miles.weights.sender import Describe, kept_groups

    tensors = weights()
    plan = tuple(tuple(b) for b in plan_of(tensors, 200))
    backend = WeightsOnly(tensors)
    spec = group("kept-test")
    assert Join(spec, plan).run(backend) == len(tensors)
    try:
        assert isinstance(Broadcast(spec.group_name, 0).run(backend), SentBucket)
        assert Close(spec.group_name, keep=True).run(backend)
        assert kept_groups() == [spec.group_name] and open_sessions() == []
        assert Describe(listen=False).run(backend).kept_group == spec.group_name
        # the next push reuses it: no rendezvous (its port is not listening any more), buckets from 0 again
        assert Join(spec, plan, reuse=True).run(backend) == len(tensors)
        assert kept_groups() == [] and open_sessions() == [spec.group_name]
        assert isinstance(Broadcast(spec.group_name, 0).run(backend), SentBucket)
        assert Close(spec.group_name, keep=True).run(backend)
        # a fresh group (other members) makes the trainer leave the kept one first
        other = group("kept-test-fresh")
        assert Join(other, plan).run(backend) == len(tensors)
        assert kept_groups() == [] and open_sessions() == [other.group_name]
        refused = Join(spec, plan, reuse=True).run(backend)
        assert isinstance(refused, GroupFailure) and "kept no such group" in refused.message
        Close(other.group_name, abort=True).run(backend)
        assert open_sessions() == [] and kept_groups() == []
    finally:
        Close(spec.group_name).run(backend)


class LaidOutWeights(WeightsOnly):
    """A backend that names where its weights lie (`push_layout_key`) and counts its walks."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.walks = 0

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.walks += 1
        yield from self.tensors.items()

    def push_layout_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors.values())


def test_a_kept_groups_join_skips_describe_until_the_trainers_tensors_change() -> None:
    from miles.weights.sender import StaleLayout, kept_groups

    tensors = weights()
    plan = tuple(tuple(b) for b in plan_of(tensors, 200))
    backend = LaidOutWeights(tensors)
    spec = group("layout-test")
    known = Join(spec, plan, reuse=True, layout_known=True)
    assert isinstance(known.run(backend), StaleLayout), "no group kept yet: Describe must decide"
    assert Join(spec, plan).run(backend) == len(tensors)
    try:
        assert Close(spec.group_name, keep=True).run(backend)
        walks = backend.walks
        assert known.run(backend) == len(tensors)  # the layout of the last push holds: joined, no Describe
        assert backend.walks == walks, "the walk is reused while the layout key holds"
        first = next(iter(tensors))
        tensors[first].add_(1)  # a step writes in place: same layout, the push sends the new values
        assert isinstance(Broadcast(spec.group_name, 0).run(backend), SentBucket)
        assert Close(spec.group_name, keep=True).run(backend)
        tensors[first] = tensors[first].clone()  # other memory: the walk is redone, the metas still match
        assert known.run(backend) == len(tensors) and backend.walks == walks + 1
        assert Close(spec.group_name, keep=True).run(backend)
        tensors["extra.weight"] = torch.zeros(2)  # another tensor list: the driver's plan is stale
        stale = known.run(backend)
        assert isinstance(stale, StaleLayout) and "changed" in stale.reason
        assert kept_groups() == [spec.group_name] and open_sessions() == [], "a stale Join changes nothing"
    finally:
        Close(spec.group_name).run(backend)


def test_a_rank_sender_owns_its_sessions_and_kept_groups() -> None:
    from miles.weights.sender import RankSender, kept_groups

    tensors = weights()
    plan = tuple(tuple(b) for b in plan_of(tensors, 200))
    backend = WeightsOnly(tensors)
    spec = group("owner-test")
    own = RankSender()
    assert own.join(backend, None, Join(spec, plan)) == len(tensors)
    try:
        assert own.open_sessions() == [spec.group_name] and spec.group_name not in open_sessions()
        assert own.keep(spec.group_name)
        assert own.kept_groups() == [spec.group_name] and spec.group_name not in kept_groups()
    finally:
        assert own.close(spec.group_name)
    assert own.open_sessions() == [] and own.kept_groups() == []
