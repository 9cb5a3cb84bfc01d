"""The catalog controller's decisions against a small in-memory backend: lazy start, sharing,
expansion, exclusive full tenants, capacity errors, leases, fencing, quarantine, health, and a clean
pool after cycles."""

from __future__ import annotations

import asyncio

import pytest

from miles.catalog.controller import CatalogController
from miles.catalog.errors import (
    CapacityError,
    HandleExpired,
    StaleEpoch,
    TrainModeNotAllowed,
    UnknownCatalogModel,
)
from miles.catalog.states import InstanceState
from miles.contract.catalog import PoolNode
from miles.errors import Category, NotFoundError, UnavailableError, UserError
from miles.types import LoraSpec
from tests.fast.catalog.memory_backend import Clock, MemoryBackend, catalog_model

LORA = LoraSpec(rank=8)


def controller_for(
    nodes: list[PoolNode], clock: Clock, *models, **kw
) -> tuple[CatalogController, MemoryBackend]:
    backend = MemoryBackend(nodes)
    return CatalogController(list(models) or [catalog_model()], backend, clock=clock, **kw), backend


async def test_no_instance_starts_until_a_handle_is_created(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    await ctl.start_residents()
    assert backend.started == [] and ctl.free_by_node() == {"10.0.0.2": 4, "10.0.0.9": 4}
    got = await ctl.acquire("m1", "tiny-a", "lora", LORA)
    assert [s.instance_id for s in backend.started] == [got.instance_id]
    assert backend.started[0].node == "10.0.0.2"  # the head is used last
    assert ctl.free_by_node() == {"10.0.0.2": 2, "10.0.0.9": 4}


async def test_concurrent_acquires_of_one_model_wait_on_the_same_start(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    backend.gate = asyncio.Event()
    pending = [asyncio.ensure_future(ctl.acquire(f"m{i}", "tiny-a", "lora", LORA)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert len(backend.started) == 1 and not any(p.done() for p in pending)
    backend.gate.set()
    first, second = await asyncio.gather(*pending)
    assert first.instance_id == second.instance_id and first.runtime is second.runtime


async def test_lora_tenants_share_then_expand_then_are_refused(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = [await ctl.acquire(f"m{i}", "tiny-a", "lora", LORA) for i in range(4)]
    assert got[0].instance_id == got[1].instance_id  # two slots per instance
    assert got[2].instance_id == got[3].instance_id != got[0].instance_id  # expansion
    assert [s.node for s in backend.started] == ["10.0.0.2", "10.0.0.2"]
    for i in range(4, 8):  # 4 instances of 2 GPUs fill the two nodes: 8 slots
        await ctl.acquire(f"m{i}", "tiny-a", "lora", LORA)
    with pytest.raises(CapacityError) as refused:
        await ctl.acquire("m8", "tiny-a", "lora", LORA)
    assert refused.value.category is Category.NO_CAPACITY
    assert refused.value.details == {
        "model": "tiny-a",
        "train_mode": "lora",
        "asked": {"gpus_on_one_node": 2},
        "free": {"10.0.0.2": 0, "10.0.0.9": 0},
    }
    assert "tiny-a" in str(refused.value) and "10.0.0.9: 0" in str(refused.value)


async def test_capacity_is_per_node_not_the_pool_total(clock) -> None:
    nodes = [PoolNode("10.0.0.1", 3), PoolNode("10.0.0.2", 3)]
    ctl, _ = controller_for(nodes, clock)
    await ctl.acquire("a", "tiny-a", "full", None)
    await ctl.acquire("b", "tiny-a", "full", None)
    with pytest.raises(CapacityError) as refused:  # 2 GPUs free in all, but 1 per node
        await ctl.acquire("c", "tiny-a", "full", None)
    assert refused.value.details["free"] == {"10.0.0.1": 1, "10.0.0.2": 1}


async def test_a_full_tenant_owns_its_instance_alone(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock)
    lora = await ctl.acquire("l1", "tiny-a", "lora", LORA)
    full = await ctl.acquire("f1", "tiny-a", "full", None)
    assert full.instance_id != lora.instance_id
    other = await ctl.acquire("l2", "tiny-a", "lora", LORA)
    assert other.instance_id == lora.instance_id  # never onto the full tenant's instance


async def test_each_instance_is_started_for_one_mode_and_serves_tenants_of_that_mode_only(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    full = await ctl.acquire("f1", "tiny-a", "full", None)
    await ctl.release("f1")  # its instance empties and is released: a LoRA tenant cannot land on it
    lora = await ctl.acquire("l1", "tiny-a", "lora", LORA)
    assert [s.train_mode for s in backend.started] == ["full", "lora"]
    assert lora.instance_id != full.instance_id
    full_again = await ctl.acquire("f2", "tiny-a", "full", None)
    assert full_again.instance_id != lora.instance_id and backend.started[-1].train_mode == "full"


async def test_concurrent_full_creations_for_the_last_capacity_have_exactly_one_winner(clock) -> None:
    ctl, backend = controller_for([PoolNode("10.0.0.1", 2)], clock)
    backend.gate = asyncio.Event()
    racers = [ctl.acquire(f"f{i}", "tiny-a", "full", None) for i in range(5)]
    gathered = asyncio.gather(*racers, return_exceptions=True)
    await asyncio.sleep(0.01)
    backend.gate.set()
    results = await gathered
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1 and len(backend.started) == 1
    assert len(losers) == 4 and all(isinstance(e, CapacityError) for e in losers)


async def test_unknown_models_modes_and_ranks_are_refused_with_the_fix(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock, catalog_model(train_modes=("lora",), max_lora_rank=16))
    with pytest.raises(UnknownCatalogModel, match="use one of: tiny-a"):
        await ctl.acquire("m", "nope", "lora", LORA)
    with pytest.raises(TrainModeNotAllowed, match="allows train modes lora, not 'full'"):
        await ctl.acquire("m", "tiny-a", "full", None)
    with pytest.raises(TrainModeNotAllowed, match="max_lora_rank 16"):
        await ctl.acquire("m", "tiny-a", "lora", LoraSpec(rank=64))
    assert ctl.free_by_node() == {"10.0.0.2": 4, "10.0.0.9": 4}


async def test_a_handle_idle_expires_even_while_other_activity_goes_on(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    await ctl.acquire("idle", "tiny-a", "lora", LORA)
    await ctl.acquire("busy", "tiny-a", "lora", LORA)
    for _ in range(7):  # 70 s: the session may heartbeat all it likes, only operations touch a lease
        clock.now += 10
        ctl.touch("busy")
        assert await ctl.expire_idle() == (["idle"] if _ == 5 else [])
    idle_text = "expired: it had no training or sampling operation for 60 s"
    with pytest.raises(HandleExpired, match=idle_text) as expired:
        ctl.touch("idle")
    assert expired.value.category is Category.EXPIRED
    ctl.touch("busy")
    assert backend.live[ctl.instances()[0].instance_id].released == ["idle"]  # its slot was reset


async def test_max_lifetime_ends_a_busy_handle(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock, catalog_model(max_lifetime_s=100.0))
    await ctl.acquire("m", "tiny-a", "lora", LORA)
    for _ in range(9):
        clock.now += 10
        ctl.touch("m")
    clock.now += 10
    with pytest.raises(HandleExpired, match="expired: it reached its maximum lifetime of 100 s"):
        ctl.touch("m")  # lazily, before any sweep
    with pytest.raises(HandleExpired):
        ctl.check_epoch("m", 1)


async def test_last_tenant_leaving_a_dynamic_instance_releases_its_gpus(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "full", None)
    clock.now += 61
    assert await ctl.expire_idle() == ["m"]
    assert backend.stopped == [got.instance_id]
    assert ctl.instances() == [] and ctl.free_by_node() == {"10.0.0.2": 4, "10.0.0.9": 4}


async def test_recreation_after_expiry_starts_clean_on_a_new_epoch(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock)
    first = await ctl.acquire("m", "tiny-a", "lora", LORA)
    clock.now += 61
    await ctl.expire_idle()
    again = await ctl.acquire("m", "tiny-a", "lora", LORA)
    assert again.epoch > first.epoch and again.runtime is not first.runtime
    ctl.touch("m")  # live again, not "expired"
    with pytest.raises(StaleEpoch, match=f"admitted under instance epoch {first.epoch}"):
        ctl.check_epoch("m", first.epoch)
    assert ctl.check_epoch("m", again.epoch) is again.runtime


async def test_explicit_release_is_idempotent_and_later_operations_say_so(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    await ctl.acquire("m", "tiny-a", "lora", LORA)
    await ctl.release("m")
    await ctl.release("m")
    assert len(backend.stopped) == 1
    with pytest.raises(HandleExpired, match="was released"):
        ctl.handle_runtime("m")
    with pytest.raises(NotFoundError):
        ctl.touch("never-created")


async def test_resident_instances_start_at_bring_up_reset_and_never_release(two_nodes, clock) -> None:
    resident = catalog_model("res", resident=True, train_modes=("full",))
    ctl, backend = controller_for(two_nodes, clock, resident)
    await ctl.start_residents()
    assert len(backend.started) == 1
    first = await ctl.acquire("t1", "res", "full", None)
    await ctl.release("t1")
    assert backend.stopped == [] and first.runtime.released == ["t1"]  # reset, not released
    second = await ctl.acquire("t2", "res", "full", None)
    assert second.instance_id == first.instance_id and len(backend.started) == 1


async def test_a_slot_is_held_until_its_reset_finished(clock) -> None:
    resident = catalog_model("res", resident=True, train_modes=("full",))
    ctl, _ = controller_for([PoolNode("10.0.0.1", 2)], clock, resident)
    await ctl.start_residents()
    await ctl.acquire("t1", "res", "full", None)
    releasing = asyncio.ensure_future(ctl.release("t1"))
    await asyncio.sleep(0)  # the lease ended, the reset is in flight
    with pytest.raises(CapacityError):
        await ctl.acquire("t2", "res", "full", None)
    await releasing
    await ctl.acquire("t2", "res", "full", None)


async def test_quarantine_ends_tenants_with_the_cause_and_releases_a_dynamic_instance(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "lora", LORA)
    await ctl.quarantine(got.instance_id, "forward_backward exceeded its execution timeout (600 s)")
    with pytest.raises(HandleExpired, match="quarantined: forward_backward exceeded"):
        ctl.check_epoch("m", got.epoch)
    assert backend.stopped == [got.instance_id] and ctl.instances() == []
    assert (
        got.instance_id in backend.stopped
        and (await ctl.acquire("n", "tiny-a", "lora", LORA)).epoch > got.epoch
    )


async def test_quarantine_restarts_a_resident_under_a_new_epoch(clock) -> None:
    ctl, backend = controller_for([PoolNode("10.0.0.1", 2)], clock, catalog_model("res", resident=True))
    await ctl.start_residents()
    got = await ctl.acquire("m", "res", "lora", LORA)
    await ctl.quarantine(got.instance_id, "optim_step timed out")
    (replacement,) = ctl.instances()
    assert replacement.state is InstanceState.READY and replacement.spec.epoch > got.epoch
    assert backend.stopped == [got.instance_id] and ctl.free_by_node() == {"10.0.0.1": 0}


async def test_a_failed_start_frees_the_gpus_and_fails_every_waiter(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    backend.fail_next_start = "CUDA out of memory"
    results = await asyncio.gather(
        ctl.acquire("a", "tiny-a", "lora", LORA),
        ctl.acquire("b", "tiny-a", "lora", LORA),
        return_exceptions=True,
    )
    assert all(isinstance(r, UnavailableError) and "CUDA out of memory" in str(r) for r in results)
    assert ctl.instances() == [] and ctl.free_by_node() == {"10.0.0.2": 4, "10.0.0.9": 4}
    with pytest.raises(HandleExpired, match="failed to start"):
        ctl.touch("a")


async def test_a_failed_stop_keeps_the_gpus_counted_until_a_retry_succeeds(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    await ctl.acquire("m", "tiny-a", "full", None)
    backend.fail_stop = True
    await ctl.release("m")
    (stuck,) = ctl.instances()
    assert stuck.state is InstanceState.RELEASING and ctl.free_by_node()["10.0.0.2"] == 2
    backend.fail_stop = False
    await ctl.expire_idle()
    assert ctl.instances() == [] and ctl.free_by_node()["10.0.0.2"] == 4


async def test_dead_instances_are_released_and_a_dead_resident_makes_the_job_unhealthy(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock, catalog_model(), catalog_model("res", resident=True))
    await ctl.start_residents()
    dynamic = await ctl.acquire("m", "tiny-a", "lora", LORA)
    backend.live.pop(dynamic.instance_id)
    assert await ctl.check_health() == [dynamic.instance_id]
    assert ctl.health_problem() is None
    with pytest.raises(HandleExpired, match="died: its actors are gone"):
        ctl.touch("m")
    (resident,) = ctl.instances()
    backend.live.pop(resident.instance_id)
    await ctl.check_health()
    assert "resident instance" in (ctl.health_problem() or "")


async def test_ten_create_release_cycles_leave_the_pool_as_it_was(two_nodes, clock) -> None:
    ctl, backend = controller_for(
        two_nodes, clock, catalog_model(), catalog_model("tiny-b", gpus_per_instance=4)
    )
    before = ctl.free_by_node()
    for cycle in range(10):
        handles = [f"c{cycle}-{i}" for i in range(3)]
        await ctl.acquire(handles[0], "tiny-a", "lora", LORA)
        await ctl.acquire(handles[1], "tiny-a", "full", None)
        await ctl.acquire(handles[2], "tiny-b", "full", None)
        await asyncio.gather(*(ctl.release(h) for h in handles))
    assert ctl.free_by_node() == before and ctl.instances() == []
    assert len(backend.started) == len(backend.stopped) == 30 and backend.live == {}
    assert ctl.snapshot()["handles"] == 0


async def test_snapshot_shows_models_instances_tenants_and_the_free_pool(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock, catalog_model(), catalog_model("tiny-b"))
    got = await ctl.acquire("m", "tiny-a", "lora", LORA)
    clock.now += 5
    snap = ctl.snapshot()
    a, b = snap["models"]
    assert (a["name"], b["name"], b["instances"]) == ("tiny-a", "tiny-b", [])
    (instance,) = a["instances"]
    assert instance == {
        "instance_id": got.instance_id,
        "epoch": got.epoch,
        "node": "10.0.0.2",
        "gpus": 2,
        "train_mode": "lora",
        "state": "ready",
        "resident": False,
        "tenants": [{"model_id": "m", "train_mode": "lora", "idle_s": 5.0}],
        "idle_s": 5.0,
        "cause": None,
    }
    assert snap["pool"]["free_gpus"] == 6 and snap["pool"]["total_gpus"] == 8
    assert [n["node"] for n in snap["pool"]["nodes"]] == ["10.0.0.2", "10.0.0.9"]


async def test_close_stops_every_instance_including_one_still_starting(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock, catalog_model(), catalog_model("res", resident=True))
    await ctl.start_residents()
    await ctl.acquire("m", "tiny-a", "full", None)
    backend.gate = asyncio.Event()
    starting = asyncio.ensure_future(ctl.acquire("n", "tiny-a", "full", None))
    await asyncio.sleep(0.01)
    await ctl.close()
    with pytest.raises(UnavailableError):
        await starting
    assert ctl.instances() == [] and ctl.free_by_node() == {"10.0.0.2": 4, "10.0.0.9": 4}
    assert backend.live == {} and len(backend.stopped) == 3


# ---- pinned by the planning mutation run (docs/testing.md, "Mutation testing") ----------------------------

ALL_FREE = {"10.0.0.2": 4, "10.0.0.9": 4}


async def test_every_resident_model_gets_one_instance_in_its_default_mode(two_nodes, clock) -> None:
    both = catalog_model("res-a", resident=True)  # LoRA allowed: tenants share it
    full_only = catalog_model("res-b", resident=True, train_modes=("full",))
    ctl, backend = controller_for(two_nodes, clock, both, full_only)
    assert ctl.models() == [both, full_only]
    await ctl.start_residents()
    await ctl.start_residents()  # again: each already has its instance
    assert [(s.model.name, s.train_mode) for s in backend.started] == [("res-a", "lora"), ("res-b", "full")]
    got = await ctl.acquire("t", "res-a", "lora", LORA)
    assert got.resident is True


async def test_a_retried_acquire_gets_the_same_slot_and_a_conflicting_one_is_refused(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    first = await ctl.acquire("m", "tiny-a", "full", None)
    again = await ctl.acquire("m", "tiny-a", "full", None)
    assert again.instance_id == first.instance_id and len(backend.started) == 1
    assert first.resident is False
    with pytest.raises(UserError, match=r"model m already exists for tiny-a \(full\)"):
        await ctl.acquire("m", "tiny-a", "lora", LORA)
    assert ctl.free_by_node() == {"10.0.0.2": 2, "10.0.0.9": 4}


async def test_a_lora_rank_equal_to_max_lora_rank_is_accepted(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock)  # max_lora_rank 32
    await ctl.acquire("m", "tiny-a", "lora", LoraSpec(rank=32))


async def test_idle_time_counts_from_when_the_handle_became_usable(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    backend.gate = asyncio.Event()
    pending = asyncio.ensure_future(ctl.acquire("m", "tiny-a", "lora", LORA))
    await asyncio.sleep(0.01)
    clock.now += 50  # a slow cold start
    backend.gate.set()
    await pending
    clock.now += 30  # 80 s after the create, 30 s after the handle became usable (idle_timeout_s 60)
    assert await ctl.expire_idle() == []
    ctl.touch("m")


async def test_a_cold_start_longer_than_the_idle_timeout_does_not_expire_its_handle(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock, catalog_model(), catalog_model("res", resident=True))
    await ctl.start_residents()
    backend.gate = asyncio.Event()
    slow = asyncio.ensure_future(ctl.acquire("slow", "tiny-a", "full", None))
    await asyncio.sleep(0.01)
    await ctl.acquire("idle", "res", "lora", LORA)  # joins the ready resident at once
    clock.now += 61
    swept = await asyncio.wait_for(ctl.expire_idle(), timeout=5)  # it does not wait on the start either
    assert swept == ["idle"]  # and goes on past the starting handle
    backend.gate.set()
    await slow
    ctl.touch("slow")


async def test_a_lifetime_end_is_named_as_such_by_every_later_call(two_nodes, clock) -> None:
    ctl, backend = controller_for(
        two_nodes, clock, catalog_model(max_lifetime_s=100.0), catalog_model("tiny-b", max_lifetime_s=100.0)
    )
    swept = await ctl.acquire("swept", "tiny-a", "full", None)
    lazy = await ctl.acquire("lazy", "tiny-b", "full", None)
    clock.now += 50
    ctl.touch("swept")
    ctl.touch("lazy")
    clock.now += 50  # 100 s old, 50 s idle: the lifetime ends them
    lifetime = r"\((tiny-a|tiny-b)\) expired: it reached its maximum lifetime of 100 s"
    for _ in range(2):  # found by the operation, then answered from the receipt
        with pytest.raises(HandleExpired, match=lifetime):
            ctl.touch("lazy")
        await asyncio.sleep(0.01)  # the lease's end runs in the background
    assert backend.stopped == [lazy.instance_id]
    assert await ctl.expire_idle() == ["swept"]
    with pytest.raises(HandleExpired, match=lifetime) as expired:
        ctl.touch("swept")
    assert expired.value.public_message() == str(expired.value)
    assert backend.stopped == [lazy.instance_id, swept.instance_id] and ctl.free_by_node() == ALL_FREE
    with pytest.raises(NotFoundError, match="model never has no catalog handle"):
        ctl.touch("never")


async def test_the_snapshot_shows_each_entry_the_head_and_idle_seconds_to_the_millisecond(
    two_nodes, clock
) -> None:
    resident = catalog_model("res", resident=True, train_modes=("lora",), max_lifetime_s=3600.0)
    ctl, _ = controller_for(two_nodes, clock, catalog_model(), resident)
    await ctl.start_residents()
    snap = ctl.snapshot()
    assert {k: v for k, v in snap["models"][1].items() if k != "instances"} == {
        "name": "res",
        "train_modes": ["lora"],
        "resident": True,
        "gpus_per_instance": 2,
        "lora_slots": 2,
        "idle_timeout_s": 60.0,
        "max_lifetime_s": 3600.0,
    }
    assert snap["models"][1]["instances"][0]["idle_s"] == 0.0  # idle since its start, not since 1970
    assert snap["pool"]["nodes"] == [
        {"node": "10.0.0.2", "gpus": 4, "free": 2, "head": False},
        {"node": "10.0.0.9", "gpus": 4, "free": 4, "head": True},
    ]

    def resident_instance() -> dict:
        (shown,) = ctl.snapshot()["models"][1]["instances"]
        return shown

    await ctl.acquire("m", "res", "lora", LORA)
    assert resident_instance()["tenants"] == [{"model_id": "m", "train_mode": "lora", "idle_s": 0.0}]
    clock.now += 7
    ctl.touch("m")  # activity of the tenant is activity of its instance
    clock.now += 2.5004
    shown = resident_instance()
    assert shown["idle_s"] == 2.5 and shown["tenants"][0]["idle_s"] == 2.5
    await ctl.release("m")  # a departure counts as the instance's last activity
    clock.now += 1.5
    assert resident_instance()["idle_s"] == 1.5 and resident_instance()["tenants"] == []


async def test_after_close_a_handle_whose_instance_could_not_be_stopped_is_not_served(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "full", None)
    backend.fail_stop = True
    await ctl.close()
    (stuck,) = ctl.snapshot()["models"][0]["instances"]
    assert stuck["state"] == "releasing"
    assert stuck["cause"] == "release; stop failed: placement group removal timed out"
    with pytest.raises(UnavailableError, match=f"instance {got.instance_id} is releasing"):
        ctl.check_epoch("m", got.epoch)
    with pytest.raises(UnavailableError, match=f"instance {got.instance_id} release; stop failed"):
        await ctl.acquire("m", "tiny-a", "full", None)


async def test_close_stops_an_instance_whose_earlier_stop_failed(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "full", None)
    backend.fail_stop = True
    await ctl.release("m")
    backend.fail_stop = False
    await ctl.close()
    assert backend.stopped == [got.instance_id] and ctl.instances() == [] and ctl.free_by_node() == ALL_FREE


async def test_a_handle_whose_start_close_cancelled_says_it_failed_to_start(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    backend.gate = asyncio.Event()
    starting = asyncio.ensure_future(ctl.acquire("n", "tiny-a", "full", None))
    await asyncio.sleep(0.01)
    await ctl.close()
    with pytest.raises(UnavailableError):
        await starting
    with pytest.raises(HandleExpired, match="failed to start: CancelledError"):
        ctl.touch("n")


async def test_a_handle_released_while_its_instance_starts_is_reset_after_the_start(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    backend.gate = asyncio.Event()
    acquiring = asyncio.ensure_future(ctl.acquire("m", "tiny-a", "lora", LORA))
    await asyncio.sleep(0.01)
    releasing = asyncio.ensure_future(ctl.release("m"))
    await asyncio.sleep(0.01)
    assert not releasing.done()  # the slot's reset waits for the start
    backend.gate.set()
    await releasing
    with pytest.raises(HandleExpired, match="was released"):
        await acquiring
    (spec,) = backend.started
    assert backend.stopped == [spec.instance_id]  # then the empty instance is released
    assert ctl.instances() == [] and ctl.free_by_node() == ALL_FREE


async def test_a_slot_whose_reset_fails_quarantines_its_instance(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("a", "tiny-a", "lora", LORA)
    await ctl.acquire("b", "tiny-a", "lora", LORA)
    backend.live[got.instance_id].fail_release = True
    await ctl.release("a")  # the failure is the instance's, not the caller's
    with pytest.raises(
        HandleExpired, match="quarantined: resetting a's state failed: trainer did not answer Reset"
    ):
        ctl.touch("b")
    assert backend.stopped == [got.instance_id] and ctl.instances() == []


async def test_quarantining_an_unknown_starting_or_stopping_instance_changes_nothing(
    two_nodes, clock
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    await ctl.quarantine("tiny-a#99", "no such instance")
    backend.gate = asyncio.Event()
    starting = asyncio.ensure_future(ctl.acquire("m", "tiny-a", "full", None))
    await asyncio.sleep(0.01)
    (instance,) = ctl.instances()
    await ctl.quarantine(instance.instance_id, "timed out")
    assert instance.state is InstanceState.STARTING
    backend.gate.set()
    await starting
    backend.fail_stop = True
    await ctl.release("m")
    await ctl.quarantine(instance.instance_id, "timed out")
    assert instance.state is InstanceState.RELEASING
    assert instance.cause == "release; stop failed: placement group removal timed out"


async def test_a_quarantined_instance_whose_stop_fails_keeps_the_quarantine_cause(two_nodes, clock) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "lora", LORA)
    backend.fail_stop = True
    await ctl.quarantine(got.instance_id, "optim_step timed out")
    (stuck,) = ctl.snapshot()["models"][0]["instances"]
    assert (
        stuck["cause"]
        == "was quarantined: optim_step timed out; stop failed: placement group removal timed out"
    )


async def test_a_quarantined_resident_comes_back_as_a_resident_in_its_mode(clock) -> None:
    ctl, backend = controller_for([PoolNode("10.0.0.1", 2)], clock, catalog_model("res", resident=True))
    await ctl.start_residents()
    got = await ctl.acquire("m", "res", "lora", LORA)
    await ctl.quarantine(got.instance_id, "optim_step timed out")
    (replacement,) = ctl.instances()
    assert replacement.resident is True and [s.train_mode for s in backend.started] == ["lora", "lora"]
    await ctl.acquire("n", "res", "lora", LORA)
    await ctl.release("n")
    assert ctl.instances() == [replacement]  # a resident is reset, never released


async def test_a_resident_that_cannot_come_back_makes_the_job_unhealthy(clock) -> None:
    resident = catalog_model("res", resident=True)
    ctl, backend = controller_for([PoolNode("10.0.0.1", 2)], clock, resident)
    await ctl.start_residents()
    (first,) = ctl.instances()
    backend.fail_stop = True  # its GPUs do not come back: no room for the replacement
    await ctl.quarantine(first.instance_id, "optim_step timed out")
    assert "resident res could not restart: no capacity" in (ctl.health_problem() or "")

    ctl, backend = controller_for([PoolNode("10.0.0.1", 2)], clock, resident)
    await ctl.start_residents()
    (first,) = ctl.instances()
    backend.fail_next_start = "CUDA out of memory"  # the replacement's start fails
    await ctl.quarantine(first.instance_id, "optim_step timed out")  # returns: the job's health says it
    assert "failed to start: RuntimeError: CUDA out of memory" in (ctl.health_problem() or "")
    assert ctl.instances() == [] and ctl.free_by_node() == {"10.0.0.1": 2}


class SlowStopBackend(MemoryBackend):
    """Stops wait for `stop_gate`; counts the backend stops asked for."""

    def __init__(self, nodes: list[PoolNode]) -> None:
        super().__init__(nodes)
        self.stop_gate = asyncio.Event()
        self.stop_calls = 0

    async def stop(self, spec) -> None:
        self.stop_calls += 1
        await self.stop_gate.wait()
        await super().stop(spec)


async def test_the_sweep_does_not_stop_an_instance_twice_while_its_stop_is_in_flight(
    two_nodes, clock
) -> None:
    backend = SlowStopBackend(two_nodes)
    ctl = CatalogController([catalog_model()], backend, clock=clock)
    await ctl.acquire("m", "tiny-a", "full", None)
    releasing = asyncio.ensure_future(ctl.release("m"))
    await asyncio.sleep(0.01)  # its stop is in flight
    sweeping = asyncio.ensure_future(ctl.expire_idle())  # retries failed stops only
    await asyncio.sleep(0.01)
    backend.stop_gate.set()
    await asyncio.gather(releasing, sweeping)
    assert backend.stop_calls == 1 and ctl.instances() == [] and ctl.free_by_node() == ALL_FREE


async def test_a_recreated_handle_no_longer_takes_a_receipt_slot(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock, receipts_max=2)
    for model_id in ("y", "x"):
        clock.now += 1
        await ctl.acquire(model_id, "tiny-a", "full", None)
        await ctl.release(model_id)
    clock.now += 1
    await ctl.acquire("x", "tiny-a", "full", None)  # live again: its old receipt is gone
    clock.now += 1
    await ctl.acquire("z", "tiny-a", "full", None)
    await ctl.release("z")
    with pytest.raises(HandleExpired, match=r"model y .*was released"):
        ctl.touch("y")  # still one of the two kept receipts
    ctl.touch("x")


@pytest.mark.parametrize("reset_fails", [False, True])
async def test_a_release_whose_instance_is_quarantined_during_the_reset_still_returns(
    two_nodes, clock, reset_fails: bool
) -> None:
    ctl, backend = controller_for(two_nodes, clock)
    got = await ctl.acquire("a", "tiny-a", "lora", LORA)
    await ctl.acquire("b", "tiny-a", "lora", LORA)
    runtime, gate = backend.live[got.instance_id], asyncio.Event()

    async def slow_reset(model_id: str) -> None:
        await gate.wait()
        if reset_fails:
            raise RuntimeError("the trainer is gone")
        runtime.released.append(model_id)

    runtime.release_model = slow_reset
    releasing = asyncio.ensure_future(ctl.release("a"))
    await asyncio.sleep(0.01)  # a's slot is being reset
    await ctl.quarantine(got.instance_id, "optim_step timed out")
    gate.set()
    await releasing
    assert backend.stopped == [got.instance_id] and ctl.instances() == [] and ctl.free_by_node() == ALL_FREE


async def test_after_close_an_operation_on_a_handle_is_refused_as_expired(two_nodes, clock) -> None:
    ctl, _ = controller_for(two_nodes, clock)
    got = await ctl.acquire("m", "tiny-a", "full", None)
    await ctl.close()  # its instance is stopped; the lease is not ended (docs/testing.md, planning survivors)
    with pytest.raises(HandleExpired):
        ctl.check_epoch("m", got.epoch)
