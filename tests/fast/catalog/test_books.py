"""The catalog's pure books: the instance state machine's table, the device pool, leases, receipts."""

from __future__ import annotations

import itertools

import pytest

from miles.catalog.api import InstanceSpec
from miles.catalog.instances import Instance, choose_instance, has_room, instance_id_for
from miles.catalog.leases import Lease
from miles.catalog.pool import DevicePool, PoolError
from miles.catalog.receipt_store import bounded_index
from miles.catalog.receipts import Receipt, ReceiptLog
from miles.catalog.states import TRANSITIONS, InstanceState, check_transition
from miles.contract.catalog import PoolNode, fits
from miles.errors import IllegalTransition
from tests.fast.catalog.memory_backend import catalog_model

S = InstanceState
ALLOWED = {
    (S.STARTING, S.READY),
    (S.STARTING, S.FAILED),
    (S.READY, S.QUARANTINED),
    (S.READY, S.FAILED),
    (S.READY, S.RELEASING),
    (S.QUARANTINED, S.RELEASING),
    (S.FAILED, S.RELEASING),
    (S.RELEASING, S.RELEASED),
}


@pytest.mark.parametrize(("current", "target"), list(itertools.product(S, S)))
def test_every_move_is_allowed_exactly_when_the_table_says(current: S, target: S) -> None:
    assert ((current, target) in ALLOWED) == (target in TRANSITIONS[current])
    if (current, target) in ALLOWED:
        check_transition("x#1", current, target)
    else:
        with pytest.raises(IllegalTransition, match=f"x#1: {current.value} -> {target.value}"):
            check_transition("x#1", current, target)


def test_the_pool_puts_the_head_last_and_claims_first_fit() -> None:
    pool = DevicePool(
        [PoolNode("10.0.0.1", 4, is_head=True), PoolNode("10.0.0.3", 2), PoolNode("10.0.0.2", 4)]
    )
    assert [n.node for n in pool.nodes] == ["10.0.0.2", "10.0.0.3", "10.0.0.1"]
    assert pool.find_node(3) == "10.0.0.2"
    pool.claim("10.0.0.2", 3)
    assert pool.find_node(2) == "10.0.0.3" and pool.find_node(4) == "10.0.0.1" and pool.find_node(5) is None
    with pytest.raises(PoolError, match="1 free"):
        pool.claim("10.0.0.2", 2)
    with pytest.raises(PoolError, match="not in the pool"):
        pool.claim("10.9.9.9", 1)
    pool.free("10.0.0.2", 3)
    with pytest.raises(PoolError, match="more than it has"):
        pool.free("10.0.0.2", 1)
    assert pool.free_total() == pool.capacity_total() == 10
    with pytest.raises(PoolError, match="repeat"):
        DevicePool([PoolNode("a", 1), PoolNode("a", 1)])


@pytest.mark.parametrize(
    ("capacities", "demands", "expected"),
    [([4, 4], [3, 3], True), ([4, 4], [3, 3, 2], False), ([4, 4], [4, 2, 2], True), ([8], [], True)],
)
def test_fits_packs_instances_one_node_each(capacities, demands, expected) -> None:
    assert fits(capacities, demands) is expected


def lease(**changes) -> Lease:
    base = dict(model_id="m", base_model="a", train_mode="lora", instance_id="a#1", epoch=1, created_at=0.0,
                last_active_at=0.0, idle_timeout_s=10.0, max_lifetime_s=100.0)  # fmt: skip
    return Lease(**{**base, **changes})


def test_a_lease_expires_on_idleness_or_age_whichever_comes_first() -> None:
    assert lease().expiry(9.9) is None and lease().expiry(10.0) == "idle"
    kept_busy = lease().touched(95.0)
    assert kept_busy.expiry(99.0) is None and kept_busy.expiry(100.0) == "lifetime"
    assert lease().touched(5.0).touched(3.0).last_active_at == 5.0  # never moves back
    assert lease(max_lifetime_s=None).touched(1e9).expiry(1e9 + 1) is None
    assert Lease.from_json(lease().to_json()) == lease()


def test_receipts_are_bounded_in_number_and_age() -> None:
    log = ReceiptLog(max_count=3, max_age_s=60.0)
    for i in range(5):
        log.record(Receipt(f"m{i}", "idle", "expired", at=float(i)))
    assert len(log) == 3 and log.get("m0", 5.0) is None and log.get("m4", 5.0) is not None
    assert log.get("m2", 61.9) is not None and log.get("m2", 62.0) is None  # aged out
    assert len(log) == 2
    log.record(Receipt("m3", "released", "released", at=70.0))  # re-recording renews its age
    assert log.get("m3", 125.0).reason == "released" and log.get("m4", 125.0) is None
    with pytest.raises(ValueError):
        ReceiptLog(max_count=0, max_age_s=1)


def test_tenancy_packs_lora_and_keeps_full_alone() -> None:
    model = catalog_model(lora_slots=3)

    def spec(epoch: int) -> InstanceSpec:
        return InstanceSpec(model, instance_id_for(model.name, epoch), epoch, "n", 2)

    a, b, full = Instance(spec(1), False), Instance(spec(2), False), Instance(spec(3), False)
    a.tenants, b.tenants, full.tenants = {"x": "lora"}, {"y": "lora", "z": "lora"}, {"f": "full"}
    for i in (a, b, full):
        i.state = S.READY
    assert choose_instance([a, b, full], model.name, "lora") is b  # the fullest with room
    assert not has_room(full, "lora") and not has_room(a, "full")
    b.tenants["w"] = "lora"
    assert choose_instance([a, b, full], model.name, "lora") is a
    a.state = S.QUARANTINED
    assert choose_instance([a, b, full], model.name, "lora") is None
    assert instance_id_for("Qwen/Qwen3 8B", 7) == "Qwen_Qwen3_8B#7"


# ---- pinned by the planning mutation run (docs/testing.md, "Mutation testing") ----------------------------


def test_the_pool_claims_a_single_gpu_but_never_none() -> None:
    pool = DevicePool([PoolNode("10.0.0.1", 2)])
    pool.claim("10.0.0.1", 1)
    assert pool.free_by_node() == {"10.0.0.1": 1}
    with pytest.raises(PoolError, match="cannot claim 0 GPU"):
        pool.claim("10.0.0.1", 0)


def test_fits_places_the_largest_instances_first() -> None:
    assert fits([2, 3], [1, 2, 2])  # smallest first would put the 1 on the 2-GPU node and strand a 2


def test_a_lease_is_not_idle_at_its_last_activity() -> None:
    assert lease().idle_s(0.0) == 0.0 and lease().idle_s(0.25) == 0.25
    assert lease(idle_timeout_s=0.5).expiry(0.25) is None


def test_a_receipt_log_may_keep_one_receipt_and_forgets_a_recreated_handle() -> None:
    log = ReceiptLog(max_count=1, max_age_s=60.0)
    log.record(Receipt("a", "idle", "expired", at=0.0))
    log.record(Receipt("b", "released", "released", at=1.0))
    assert len(log) == 1 and log.get("a", 1.0) is None and log.get("b", 1.0) is not None
    log.forget("b")
    assert log.get("b", 1.0) is None and len(log) == 0
    with pytest.raises(ValueError, match="max_count >= 1 and max_age_s > 0"):
        ReceiptLog(max_count=1, max_age_s=0)


def receipt(model_id: str, at: float) -> Receipt:
    return Receipt(model_id, "released", f"model {model_id} was released", at)


def test_the_receipt_index_holds_each_handle_once_at_its_newest_time_oldest_first() -> None:
    kept, dropped = bounded_index(
        [["old", 0.0], ["b", 1.0]],
        [receipt("b", 9.0), receipt("z", 5.0), receipt("b", 7.0)],
        max_count=2,
        max_age_s=600.0,
    )
    assert kept == [["z", 5.0], ["b", 9.0]] and dropped == ["old"]


def test_the_receipt_index_drops_an_entry_exactly_max_age_s_old() -> None:
    kept, dropped = bounded_index([["old", 0.0]], [receipt("new", 600.0)], max_count=10, max_age_s=600.0)
    assert kept == [["new", 600.0]] and dropped == ["old"]
