"""A controller restarted on the same StateStore (a real redis-server, and the memory store) recovers its
books: live instances are re-adopted or stopped, dead ones stopped, nothing counted twice."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from miles.catalog.controller import CatalogController
from miles.catalog.errors import ControllerSuperseded, HandleExpired
from miles.catalog.receipt_store import RECEIPTS_NS, StoredReceipts
from miles.catalog.receipts import Receipt
from miles.contract.catalog import PoolNode
from miles.errors import NotFoundError
from miles.state import MemoryStateStore, StateStore, StateStoreUnavailable
from miles.types import LoraSpec
from tests.fast.catalog.memory_backend import AdoptingMemoryBackend, Clock, MemoryBackend, catalog_model

NODES = [PoolNode("10.0.0.1", 4), PoolNode("10.0.0.2", 4, is_head=True)]
MODELS = [catalog_model(), catalog_model("res", resident=True)]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield MemoryStateStore()
        return
    from miles.state.redis_store import RedisStateStore

    red = RedisStateStore(request.getfixturevalue("redis_url"), key_prefix=f"catalog-{uuid.uuid4().hex[:10]}")
    try:
        yield red
    finally:
        await red.purge()
        await red.close()


async def first_life(store: StateStore, backend: MemoryBackend, clock: Clock) -> dict[str, int]:
    ctl = CatalogController(MODELS, backend, store=store, clock=clock)
    await ctl.recover()
    await ctl.start_residents()
    epochs = {}
    for model_id, mode in (("shared", "lora"), ("owner", "full")):
        epochs[model_id] = (
            await ctl.acquire(model_id, "tiny-a", mode, LoraSpec(rank=8) if mode == "lora" else None)
        ).epoch
    return epochs  # the controller "crashes" here: no close(), its instances keep running


async def test_a_restart_re_adopts_live_instances_and_releases_dead_ones(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    epochs = await first_life(store, backend, clock)
    owner_instance = next(s.instance_id for s in backend.started if s.epoch == epochs["owner"])
    backend.live.pop(owner_instance)  # its actors died while no controller watched

    clock.now += 5
    ctl = CatalogController(MODELS, backend, store=store, clock=clock)
    await ctl.recover()
    await ctl.start_residents()
    assert len(backend.started) == 3  # the resident was re-adopted, not started again
    assert owner_instance in backend.stopped
    assert ctl.free_by_node() == {"10.0.0.1": 0, "10.0.0.2": 4}  # resident + shared, each counted once
    await ctl.recover()  # again: the books already hold them
    assert ctl.free_by_node() == {"10.0.0.1": 0, "10.0.0.2": 4} and len(backend.live) == 2
    runtime, epoch = ctl.handle_runtime("shared")
    shared_instance = next(i.instance_id for i in ctl.instances() if i.spec.epoch == epoch)
    assert epoch == epochs["shared"] and runtime is backend.live[shared_instance]  # the same actors
    assert backend.adopted[shared_instance] == ["shared"]  # told its tenants' handles
    ctl.touch("shared")
    with pytest.raises(HandleExpired, match="lost in a restart"):
        ctl.touch("owner")
    fresh = await ctl.acquire("later", "tiny-a", "full", None)
    assert fresh.epoch > max(epochs.values())  # epochs never repeat across restarts


async def test_without_adopt_live_instances_are_stopped_and_the_pool_is_whole_again(store, clock) -> None:
    backend = MemoryBackend(NODES)
    await first_life(store, backend, clock)
    ctl = CatalogController(MODELS, backend, store=store, clock=clock)
    await ctl.recover()
    assert backend.live == {} and ctl.instances() == []
    assert ctl.free_by_node() == {"10.0.0.1": 4, "10.0.0.2": 4}
    await ctl.start_residents()
    assert ctl.free_by_node() == {"10.0.0.1": 2, "10.0.0.2": 4}
    with pytest.raises(HandleExpired):
        ctl.touch("shared")


async def test_a_released_handle_stays_released_after_a_restart(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    ctl = CatalogController(MODELS, backend, store=store, clock=clock)
    await ctl.acquire("gone", "tiny-a", "full", None)
    await ctl.release("gone")
    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    assert again.instances() == [] and again.free_by_node() == {"10.0.0.1": 4, "10.0.0.2": 4}


async def test_a_controller_superseded_by_a_recovered_one_cannot_overwrite_its_books(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    stale = CatalogController(MODELS, backend, store=store, clock=clock)
    await stale.acquire("a", "tiny-a", "full", None)
    live = CatalogController(MODELS, backend, store=store, clock=clock)
    await live.recover()
    with pytest.raises(ControllerSuperseded, match="took over the allocation state"):
        await stale.acquire("b", "tiny-a", "full", None)
    await live.acquire("c", "tiny-a", "full", None)
    third = CatalogController(MODELS, backend, store=store, clock=clock)
    await third.recover()  # sees the live controller's books, not the stale one's claim of "b"
    tenants = [
        t["model_id"] for m in third.snapshot()["models"] for i in m["instances"] for t in i["tenants"]
    ]
    assert sorted(tenants) == ["a", "c"]


async def test_activity_reaches_the_store_with_the_sweep_so_a_restart_keeps_busy_handles(
    store, clock
) -> None:
    backend = AdoptingMemoryBackend(NODES)
    first = CatalogController(MODELS, backend, store=store, clock=clock)
    await first.acquire("busy", "tiny-a", "lora", LoraSpec(rank=8))
    clock.now += 50
    first.touch("busy")
    await first.expire_idle()
    clock.now += 50  # 100 s after creation, 50 s after the last operation (idle_timeout_s 60)
    second = CatalogController(MODELS, backend, store=store, clock=clock)
    await second.recover()
    assert await second.expire_idle() == []
    second.touch("busy")


async def test_an_instance_of_a_model_dropped_from_the_catalog_is_stopped_on_recovery(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    first = CatalogController([*MODELS, catalog_model("old")], backend, store=store, clock=clock)
    dropped = await first.acquire("x", "old", "full", None)
    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    assert backend.stopped == [dropped.instance_id] and again.instances() == []
    with pytest.raises(HandleExpired, match="lost in a restart"):
        again.touch("x")


async def test_a_restarted_controller_still_says_why_a_handle_ended(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    first = CatalogController(MODELS, backend, store=store, clock=clock)
    await first.acquire("idler", "tiny-a", "lora", LoraSpec(rank=8))
    await first.acquire("leaver", "tiny-a", "full", None)
    await first.release("leaver")
    clock.now += 61  # past idle_timeout_s 60
    assert await first.expire_idle() == ["idler"]
    before = {}
    for model_id in ("idler", "leaver"):
        with pytest.raises(HandleExpired) as ended:
            first.touch(model_id)
        before[model_id] = str(ended.value)

    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    for model_id, text in before.items():  # the same answer as before the restart, not "not found"
        with pytest.raises(HandleExpired) as ended:
            again.touch(model_id)
        assert str(ended.value) == text
    assert "no training or sampling operation for 60 s" in before["idler"]
    assert "was released" in before["leaver"]


async def test_stored_receipts_are_bounded_in_number_and_age(store, clock) -> None:
    backend = AdoptingMemoryBackend(NODES)
    first = CatalogController(MODELS, backend, store=store, clock=clock, receipts_max=3, receipts_age_s=600)
    for n in range(5):
        clock.now += 1
        await first.acquire(f"m{n}", "tiny-a", "full", None)
        await first.release(f"m{n}")
    assert sorted(key for key, _ in await store.list(RECEIPTS_NS)) == ["m2", "m3", "m4"]

    again = CatalogController(MODELS, backend, store=store, clock=clock, receipts_max=3, receipts_age_s=600)
    await again.recover()
    for model_id in ("m0", "m1"):  # pushed out by the count: as if never created
        with pytest.raises(NotFoundError):
            again.touch(model_id)
    with pytest.raises(HandleExpired, match=r"m4 .*was released"):
        again.touch("m4")

    clock.now += 600  # every receipt is now past its age
    third = CatalogController(MODELS, backend, store=store, clock=clock, receipts_max=3, receipts_age_s=600)
    await third.recover()
    with pytest.raises(NotFoundError):
        third.touch("m4")


async def test_the_store_drops_a_receipt_key_once_it_is_older_than_the_age_bound(store, clock) -> None:
    ctl = CatalogController(MODELS, MemoryBackend(NODES), store=store, clock=clock, receipts_age_s=0.3)
    await ctl.acquire("brief", "tiny-a", "full", None)
    await ctl.release("brief")
    assert await store.get(RECEIPTS_NS, "brief") is not None
    await asyncio.sleep(0.5)  # the store's own expiry (Redis PX), not a sweep
    assert await store.get(RECEIPTS_NS, "brief") is None


class ReceiptOutageStore(MemoryStateStore):
    """The memory store, with its next receipt write failing (the store unreachable at that moment)."""

    fail_next_receipt = False

    async def put(self, ns: str, key: str, value: dict, *, ttl_s: float | None = None) -> None:
        if ns == RECEIPTS_NS and self.fail_next_receipt:
            self.fail_next_receipt = False
            raise StateStoreUnavailable("the state store did not answer")
        await super().put(ns, key, value, ttl_s=ttl_s)


async def test_a_receipt_whose_write_failed_is_written_with_the_next_change(clock) -> None:
    store, backend = ReceiptOutageStore(), AdoptingMemoryBackend(NODES)
    first = CatalogController(MODELS, backend, store=store, clock=clock)
    await first.acquire("leaver", "tiny-a", "full", None)
    await first.acquire("stayer", "tiny-a", "lora", LoraSpec(rank=8))
    store.fail_next_receipt = True
    with pytest.raises(StateStoreUnavailable):
        await first.release("leaver")
    await first.release("stayer")  # the next change writes the earlier receipt too

    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    for model_id in ("leaver", "stayer"):
        with pytest.raises(HandleExpired, match=f"model {model_id} .*was released"):
            again.touch(model_id)


# ---- pinned by the planning mutation run (docs/testing.md, "Mutation testing") ----------------------------


async def test_each_ended_handle_leaves_a_stored_receipt_with_its_reason(store, clock) -> None:
    models = [catalog_model(), catalog_model("tiny-b", max_lifetime_s=30.0)]
    ctl = CatalogController(models, AdoptingMemoryBackend(NODES), store=store, clock=clock)
    await ctl.acquire("released", "tiny-a", "lora", LoraSpec(rank=8))
    lost = await ctl.acquire("lost", "tiny-a", "lora", LoraSpec(rank=8))
    await ctl.release("released")  # its peer stays: the slot is reset, the books written meanwhile
    await ctl.quarantine(lost.instance_id, "optim_step timed out")
    await ctl.acquire("lifetime", "tiny-b", "full", None)
    await ctl.acquire("idle", "tiny-a", "full", None)
    await ctl.acquire("restart", "tiny-a", "full", None)
    clock.now += 40
    ctl.touch("restart")
    clock.now += 21  # "idle" 61 s idle, "lifetime" 61 s old, "restart" 21 s idle
    assert sorted(await ctl.expire_idle()) == ["idle", "lifetime"]
    again = CatalogController(models, MemoryBackend(NODES), store=store, clock=clock)
    await again.recover()  # no adopt: "restart"'s instance is stopped, its handle lost
    reasons = {key: value["reason"] for key, value in await store.list(RECEIPTS_NS)}
    assert reasons == {
        "released": "released",
        "lost": "instance_lost",
        "lifetime": "lifetime",
        "idle": "idle",
        "restart": "instance_lost",
    }


async def test_stored_receipts_load_back_whole_and_not_once_max_age_s_old(store) -> None:
    kept = StoredReceipts(store, max_count=10, max_age_s=600.0)
    receipt = Receipt("m", "idle", "model m (tiny-a) expired: idle", 1000.0)
    await kept.save([receipt])
    assert await kept.load(1599.5) == [receipt]
    assert await kept.load(1600.0) == []


async def test_a_restart_keeps_modes_and_activity_and_releases_an_adopted_handle_like_any_other(
    store, clock
) -> None:
    backend = AdoptingMemoryBackend(NODES)
    epochs = await first_life(store, backend, clock)
    clock.now += 5
    ctl = CatalogController(MODELS, backend, store=store, clock=clock)
    await ctl.recover()
    by_epoch = {i.spec.epoch: i for i in ctl.instances()}
    assert by_epoch[epochs["owner"]].spec.train_mode == "full"
    assert by_epoch[epochs["shared"]].spec.train_mode == "lora"
    clock.now += 2
    (resident,) = ctl.snapshot()["models"][1]["instances"]
    assert resident["idle_s"] == 2.0  # no tenants: idle since the restart
    shared = by_epoch[epochs["shared"]]
    await ctl.release("shared")  # its last tenant: the adopted instance is released
    assert shared.instance_id in backend.stopped and shared not in ctl.instances()


class StopRecordingBackend(AdoptingMemoryBackend):
    def __init__(self, nodes: list[PoolNode]) -> None:
        super().__init__(nodes)
        self.stopped_specs: list = []

    async def stop(self, spec) -> None:
        self.stopped_specs.append(spec)
        await super().stop(spec)


async def test_an_instance_of_a_dropped_model_is_stopped_by_its_stored_entry(store, clock) -> None:
    backend = StopRecordingBackend(NODES)
    first = CatalogController([*MODELS, catalog_model("old")], backend, store=store, clock=clock)
    await first.acquire("x", "old", "full", None)
    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    (spec,) = backend.stopped_specs
    assert (spec.model.name, spec.model.gpus_per_instance, spec.train_mode) == ("old", 2, "full")


async def test_an_instance_on_a_node_that_left_the_pool_is_stopped_on_recovery(store, clock) -> None:
    models = [catalog_model("tiny-1", gpus_per_instance=1)]
    backend = AdoptingMemoryBackend([PoolNode("10.0.0.7", 2)])
    first = CatalogController(models, backend, store=store, clock=clock)
    got = await first.acquire("m", "tiny-1", "full", None)
    backend.nodes = [PoolNode("10.0.0.8", 2)]
    again = CatalogController(models, backend, store=store, clock=clock)
    await again.recover()
    assert backend.stopped == [got.instance_id] and again.instances() == []
    assert again.free_by_node() == {"10.0.0.8": 2}
    with pytest.raises(HandleExpired, match="lost in a restart"):
        again.touch("m")


class SlowAdoptBackend(AdoptingMemoryBackend):
    def __init__(self, nodes: list[PoolNode]) -> None:
        super().__init__(nodes)
        self.adopting, self.adopt_gate = asyncio.Event(), asyncio.Event()

    async def adopt(self, spec, model_ids):
        self.adopting.set()
        await self.adopt_gate.wait()
        return await super().adopt(spec, model_ids)


async def test_a_restarted_controller_takes_the_books_over_before_it_adopts(store, clock) -> None:
    backend = SlowAdoptBackend(NODES)
    stale = CatalogController(MODELS, backend, store=store, clock=clock)
    await stale.acquire("a", "tiny-a", "full", None)
    live = CatalogController(MODELS, backend, store=store, clock=clock)
    recovering = asyncio.ensure_future(live.recover())
    await asyncio.wait_for(backend.adopting.wait(), timeout=10)  # adopting "a"'s instance
    with pytest.raises(ControllerSuperseded):
        await stale.acquire("b", "tiny-a", "full", None)
    backend.adopt_gate.set()
    await recovering
    live.touch("a")


class GatedReceiptOutageStore(MemoryStateStore):
    """The memory store; with `hold` set, the next receipt write waits for it, then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()  # set once a write waits on `hold`

    async def put(self, ns: str, key: str, value: dict, *, ttl_s: float | None = None) -> None:
        if ns == RECEIPTS_NS and self.hold is not None:
            hold, self.hold = self.hold, None
            self.holding.set()
            await hold.wait()
            raise StateStoreUnavailable("the state store did not answer")
        await super().put(ns, key, value, ttl_s=ttl_s)


async def test_a_receipt_recorded_while_an_earlier_write_fails_is_written_too(clock) -> None:
    store, backend = GatedReceiptOutageStore(), AdoptingMemoryBackend(NODES)
    first = CatalogController(MODELS, backend, store=store, clock=clock)
    for model_id in ("a", "b"):
        await first.acquire(model_id, "tiny-a", "full", None)
    store.hold = hold = asyncio.Event()
    failing = asyncio.ensure_future(first.release("a"))
    await asyncio.wait_for(store.holding.wait(), timeout=10)  # a's receipt write hangs
    second = asyncio.ensure_future(first.release("b"))  # b's receipt is recorded meanwhile
    await asyncio.sleep(0.01)
    hold.set()
    with pytest.raises(StateStoreUnavailable):
        await failing
    await second
    again = CatalogController(MODELS, backend, store=store, clock=clock)
    await again.recover()
    for model_id in ("a", "b"):
        with pytest.raises(HandleExpired, match=f"model {model_id} .*was released"):
            again.touch(model_id)
