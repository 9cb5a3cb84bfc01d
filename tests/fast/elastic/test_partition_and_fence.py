"""Hybrid lanes' pure rules: the partition of a batch by lane speed, and the delivery fence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.train.hybrid.fence import (
    TRANSITIONS,
    Delivery,
    FenceError,
    RecentNonces,
    Stamp,
    StepFence,
    StepState,
)
from miles.train.hybrid.partition import partition

costs_strategy = st.lists(st.integers(min_value=0, max_value=500), max_size=40)
speeds_strategy = st.lists(st.floats(min_value=1e-3, max_value=1e6), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(costs=costs_strategy, speeds=speeds_strategy)
def test_every_datum_lands_exactly_once_in_order(costs: list[int], speeds: list[float]) -> None:
    lanes = [(f"lane{i}", s) for i, s in enumerate(speeds)]
    shares = partition(costs, lanes)
    assert [s.lane for s in shares] == [name for name, _ in lanes]
    covered = [i for s in shares for i in range(s.start, s.end)]
    assert covered == list(range(len(costs)))  # each once, in batch order, contiguous per lane
    assert partition(costs, lanes) == shares  # deterministic


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(min_value=1, max_value=50), min_size=20, max_size=60))
def test_shares_follow_speed(costs: list[int]) -> None:
    fast, _slow = partition(costs, [("fast", 3.0), ("slow", 1.0)])
    total = sum(costs)
    fast_cost = sum(costs[fast.start : fast.end])
    # within one datum of the speed-proportional 3/4 of the work
    assert abs(fast_cost - 0.75 * total) <= max(costs)


def test_a_slow_lane_may_get_nothing_and_bad_speeds_are_refused() -> None:
    shares = partition([5, 5], [("core", 1000.0), ("lane", 1.0)])
    assert [(s.start, s.end) for s in shares] == [(0, 2), (2, 2)]
    assert shares[1].size == 0
    assert [s.size for s in partition([], [("a", 1.0), ("b", 2.0)])] == [0, 0]
    for speeds, match in (
        ([], "at least one live lane"),
        ([("a", 0.0)], "finite and > 0"),
        ([("a", float("nan"))], "finite and > 0"),
        ([("a", 1.0), ("a", 2.0)], "unique"),
    ):
        with pytest.raises(ValueError, match=match):
            partition([1], speeds)


STAMP = Stamp("run-1", epoch=3, step=7, version=9)
MEMBERS = frozenset({"core", "lane-a"})


def delivery(lane: str = "lane-a", nonce: str = "n1", **changes) -> Delivery:
    fields = {"run": STAMP.run, "epoch": STAMP.epoch, "step": STAMP.step, "version": STAMP.version} | changes
    return Delivery(Stamp(**fields), lane, nonce)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (delivery(run="run-0"), "foreign run"),
        (delivery(epoch=2), "stale membership epoch 2"),
        (delivery(lane="lane-z"), "not a member of epoch 3"),
        (delivery(step=6), "wrong step 6"),
        (delivery(version=8), "wrong state version 8"),
    ],
)
def test_stale_or_foreign_deliveries_are_rejected_and_the_step_cannot_release(
    bad: Delivery, reason: str
) -> None:
    fence = StepFence(STAMP, MEMBERS)
    assert fence.offer(delivery("core", "n0")).accepted
    verdict = fence.offer(bad)
    assert not verdict.accepted and reason in verdict.reason
    with pytest.raises(FenceError, match="cannot release"):
        fence.release()
    fence.abort()
    assert fence.state is StepState.ABORTED


def test_duplicates_replays_and_late_records_are_rejected() -> None:
    seen = RecentNonces()
    fence = StepFence(STAMP, MEMBERS, seen)
    assert fence.offer(delivery("core", "n0")).accepted
    assert "duplicate delivery" in fence.offer(delivery("core", "n0b")).reason
    fence.rejections.clear()
    assert fence.offer(delivery("lane-a", "n1")).accepted
    fence.release()
    assert fence.state is StepState.RELEASED
    # a late record of the released step changes nothing
    late = fence.offer(delivery("lane-a", "n9"))
    assert not late.accepted and "already released" in late.reason
    assert fence.state is StepState.RELEASED
    with pytest.raises(FenceError):
        fence.abort()  # a release cannot be undone
    # the next step shares the nonces: the old payload replayed with a fresh stamp is still caught
    nxt = StepFence(Stamp("run-1", 3, 8, 10), MEMBERS, seen)
    replay = nxt.offer(Delivery(Stamp("run-1", 3, 8, 10), "lane-a", "n1"))
    assert not replay.accepted and "replayed delivery" in replay.reason


def test_the_transition_table_is_the_whole_state_machine() -> None:
    assert set(TRANSITIONS.values()) == set(StepState)
    assert all(state is StepState.OPEN for state, _ in TRANSITIONS)  # RELEASED and ABORTED are final


def test_lane_groups_of_each_epoch_leave_the_core_group_alone(tmp_path) -> None:
    """The core trainer's default group stays the one built at startup while lane epochs come and go."""
    import torch
    import torch.distributed as torch_dist

    from miles.train.hybrid.group import LaneGroup, Membership, open_store

    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'core'}", rank=0, world_size=1)
    try:
        core_group = torch_dist.group.WORLD
        store = open_store("127.0.0.1", timeout_s=10)
        for epoch in range(3):
            group = LaneGroup(store, Membership("run", epoch, ("core",)), "core", timeout_s=10)
            flat = torch.ones(4)
            group.all_reduce_sum(flat)
            assert flat.tolist() == [1.0] * 4
        assert torch_dist.group.WORLD is core_group and torch_dist.get_world_size() == 1
        assert not torch_dist.distributed_c10d._world.pg_map.keys() - {core_group}
    finally:
        torch_dist.destroy_process_group()


def test_the_state_fingerprint_sees_one_changed_bit_and_a_swap() -> None:
    import torch

    from miles.train.hybrid import state

    base = [
        ("w", torch.linspace(-1, 1, 1000)),
        ("w::step", torch.tensor(3.0)),
        ("b", torch.ones(7).bfloat16()),
    ]
    same = [(name, tensor.clone()) for name, tensor in base]
    assert torch.equal(state.state_fingerprint(base), state.state_fingerprint(same))
    flipped = [(name, tensor.clone()) for name, tensor in base]
    flipped[0][1][123] = torch.nextafter(flipped[0][1][123], torch.tensor(2.0))  # one ulp
    swapped = [(name, tensor.clone()) for name, tensor in base]
    swapped[0][1][[10, 20]] = swapped[0][1][[20, 10]]
    stepped = [(name, tensor.clone()) for name, tensor in base]
    stepped[1] = ("w::step", torch.tensor(4.0))
    for changed in (flipped, swapped, stepped):
        assert not torch.equal(state.state_fingerprint(base), state.state_fingerprint(changed))
        assert state.state_digest(base) != state.state_digest(changed)


def test_recent_nonces_stay_bounded_and_forget_the_oldest_first() -> None:
    recent = RecentNonces(capacity=3)
    for nonce in ("a", "b", "c", "c", "d"):
        recent.add(nonce)
    assert "a" not in recent and all(n in recent for n in ("b", "c", "d"))
