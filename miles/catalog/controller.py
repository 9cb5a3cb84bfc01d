"""The catalog controller: the only writer of allocation state (instances, epochs, leases, the pool).

Every decision that reads and changes the books (which instance a tenant joins, whether the pool has
room, claiming the GPUs, ending a lease) is one synchronous step: no await between check and claim, so
concurrent requests on one event loop can never both win the last capacity. Awaits come after: the
backend start/stop, the tenant-state reset, and the write-through to the StateStore.

Who calls what (the routing runtime, docs/catalog.md):
  start_residents() once at bring-up, after recover();
  acquire(model_id, base_model, train_mode, lora) on create_model, then create_model on the returned runtime;
  handle_runtime(model_id) to route an operation, check_epoch(model_id, epoch) right before running it,
  touch(model_id) for every training or sampling operation (business activity);
  quarantine(instance_id, cause) when an operation exceeded its execution timeout;
  release(model_id) on release_model (unload, session end); it resets or stops the instance;
  expire_idle() and check_health() from periodic tasks; snapshot() for /api/v1/catalog.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from miles.catalog.api import Acquired, AdoptingBackend, InstanceBackend, InstanceSpec
from miles.catalog.errors import (
    CapacityError,
    ControllerSuperseded,
    HandleExpired,
    StaleEpoch,
    TrainModeNotAllowed,
    UnknownCatalogModel,
)
from miles.catalog.instances import (
    RESET_PREFIX,
    Instance,
    choose_instance,
    default_mode,
    instance_id_for,
    resident_mode,
)
from miles.catalog.leases import Lease, expiry_text
from miles.catalog.pool import DevicePool
from miles.catalog.receipt_store import StoredReceipts
from miles.catalog.receipts import Receipt, ReceiptLog
from miles.catalog.states import HOLDS_GPUS, InstanceState
from miles.contract.catalog import CatalogModel
from miles.errors import NotFoundError, UnavailableError, UserError
from miles.observability.catalog_metrics import CatalogMetrics
from miles.seam.runtime import Runtime
from miles.state import StateStore
from miles.types import LoraSpec

log = logging.getLogger(__name__)

STATE_NS = "catalog"
STATE_KEY = "allocation"


class CatalogController:
    def __init__(
        self,
        models: list[CatalogModel],
        backend: InstanceBackend,
        *,
        store: StateStore | None = None,
        metrics: CatalogMetrics | None = None,
        clock: Callable[[], float] = time.time,
        receipts_max: int = 4096,
        receipts_age_s: float = 24 * 3600.0,
    ) -> None:
        self._models = {m.name: m for m in models}
        self._backend = backend
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._pool = DevicePool(backend.pool_nodes())
        self._instances: dict[str, Instance] = {}
        self._leases: dict[str, Lease] = {}
        self._starts: dict[str, asyncio.Future[Runtime]] = {}
        self._receipts = ReceiptLog(max_count=receipts_max, max_age_s=receipts_age_s)
        # the same receipts in the store, so a restarted controller still says why a handle ended
        self._stored_receipts = (
            None if store is None else StoredReceipts(store, max_count=receipts_max, max_age_s=receipts_age_s)
        )
        self._unsaved_receipts: list[Receipt] = []  # recorded, written by the next _persist
        self._last_epoch = 0
        self._resident_failure: str | None = None
        self._persist_lock = asyncio.Lock()
        self._writer = uuid.uuid4().hex  # fencing token: the controller whose writes the store takes
        self._background: set[asyncio.Task[Any]] = set()

    # ---- reading --------------------------------------------------------------------------------------

    def models(self) -> list[CatalogModel]:
        return list(self._models.values())

    def instances(self) -> list[Instance]:
        return list(self._instances.values())

    def free_by_node(self) -> dict[str, int]:
        return self._pool.free_by_node()

    def health_problem(self) -> str | None:
        """Set once a resident instance died: the job cannot serve its model any more (healthz 503)."""
        return self._resident_failure

    # ---- bring-up -------------------------------------------------------------------------------------

    async def start_residents(self) -> None:
        """Start one instance of every resident model that has none (after recover()), and wait for them."""
        starting = []
        for model in self._models.values():
            held = any(i.model.name == model.name and i.resident for i in self._instances.values())
            if model.resident and not held:
                starting.append(self._new_instance(model, default_mode(model), True))
        await self._persist()
        for instance in starting:
            await self._started(instance)

    # ---- handles --------------------------------------------------------------------------------------

    async def acquire(
        self, model_id: str, base_model: str, train_mode: str, lora: LoraSpec | None
    ) -> Acquired:
        """A slot for handle `model_id`: joins an instance with room or starts one (lazily); concurrent
        acquires of one model wait on the same start. Raises CapacityError when the pool is full."""
        lease = self._leases.get(model_id)
        if lease is None:
            model = self._model_for(base_model, train_mode, lora)
            lease = self._place(model_id, model, train_mode)  # the check-and-claim: synchronous
            await self._persist()
        elif (lease.base_model, lease.train_mode) != (base_model, train_mode):
            raise UserError(f"model {model_id} already exists for {lease.base_model} ({lease.train_mode})")
        instance = self._instances[lease.instance_id]
        runtime = await self._started(instance)
        if (held := self._leases.get(model_id)) is not None:  # idle time counts once the handle is usable
            self._leases[model_id] = held.touched(self._clock())
        self._live_lease(model_id)  # it may have ended while the instance started
        return Acquired(runtime, instance.spec.epoch, instance.instance_id, instance.resident)

    def touch(self, model_id: str) -> None:
        """Record business activity on the handle (a training or sampling operation)."""
        lease = self._live_lease(model_id)
        now = self._clock()
        self._leases[model_id] = lease.touched(now)
        self._instances[lease.instance_id].last_active_at = now

    def handle_runtime(self, model_id: str) -> tuple[Runtime, int]:
        """(runtime, epoch) to route an operation of `model_id` to; pass the epoch to check_epoch."""
        lease = self._live_lease(model_id)
        return self.check_epoch(model_id, lease.epoch), lease.epoch

    def check_epoch(self, model_id: str, epoch: int) -> Runtime:
        """The runtime to run an operation admitted under `epoch` on; StaleEpoch when the handle's
        instance was restarted or replaced since, so the operation never reaches the new instance."""
        lease = self._live_lease(model_id)
        instance = self._instances.get(lease.instance_id)
        if lease.epoch != epoch or instance is None or instance.spec.epoch != epoch:
            raise StaleEpoch(
                f"model {model_id}: the operation was admitted under instance epoch {epoch}, but the "
                f"handle now runs on epoch {lease.epoch}; it was not applied. Send it again"
            )
        if instance.state is not InstanceState.READY or instance.runtime is None:
            raise UnavailableError(f"model {model_id}: instance {instance.instance_id} is {instance.state}")
        return instance.runtime

    async def release(self, model_id: str) -> None:
        """End handle `model_id` (unload, session end): its slot is reset or its instance stopped.
        Idempotent: an unknown or ended handle is a no-op."""
        lease = self._leases.get(model_id)
        if lease is None:
            return
        follow_up = self._end_lease(lease, "released", "was released")
        await self._persist()
        await follow_up

    async def expire_idle(self) -> list[str]:
        """End every lease past its idle timeout or lifetime; retry stops that failed. The model ids ended."""
        now = self._clock()
        ended, follow_ups = [], []
        for lease in list(self._leases.values()):
            reason = lease.expiry(now)
            starting = self._instances.get(lease.instance_id)
            if reason == "idle" and starting is not None and starting.state is InstanceState.STARTING:
                continue  # a cold start longer than idle_timeout_s is not the tenant being idle
            if reason is not None:
                ended.append(lease.model_id)
                follow_ups.append(self._end_lease(lease, reason, expiry_text(lease, reason)))
        follow_ups += [
            self._stop(i)
            for i in self._instances.values()
            if i.state is InstanceState.RELEASING and not i.stopping
        ]
        self._receipts.prune(now)
        if ended or self._leases:  # also the leases' activity times, which touch() keeps in memory
            await self._persist()
        for follow_up in follow_ups:
            await follow_up
        return ended

    # ---- faults ---------------------------------------------------------------------------------------

    async def quarantine(self, instance_id: str, cause: str) -> None:
        """No new work for the instance (even if its actors answer ping); its tenants' handles end with
        `cause`; it is released, and a resident one restarted under a new epoch."""
        await self._retire(instance_id, InstanceState.QUARANTINED, f"was quarantined: {cause}")

    async def check_health(self) -> list[str]:
        """Ask the backend whether each ready instance's actors are alive; retire the dead ones."""
        dead = [i.instance_id for i in self.instances() if i.state is InstanceState.READY]
        dead = [iid for iid in dead if not await self._backend.alive(self._instances[iid].spec)]
        for instance_id in dead:
            await self._retire(instance_id, InstanceState.FAILED, "died: its actors are gone")
        return dead

    # ---- visibility -----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Plain data for GET /api/v1/catalog: models, their instances, tenants, idle seconds, free pool."""
        now = self._clock()
        models = []
        for model in self._models.values():
            instances = [
                self._describe(i, now) for i in self._instances.values() if i.model.name == model.name
            ]
            models.append(
                {
                    "name": model.name,
                    "train_modes": list(model.train_modes),
                    "resident": model.resident,
                    "gpus_per_instance": model.gpus_per_instance,
                    "lora_slots": model.lora_slots,
                    "idle_timeout_s": model.idle_timeout_s,
                    "max_lifetime_s": model.max_lifetime_s,
                    "instances": instances,
                }
            )
        nodes = [
            {"node": n.node, "gpus": n.gpus, "free": self._pool.free_by_node()[n.node], "head": n.is_head}
            for n in self._pool.nodes
        ]
        pool = {
            "nodes": nodes,
            "free_gpus": self._pool.free_total(),
            "total_gpus": self._pool.capacity_total(),
        }
        return {"models": models, "pool": pool, "handles": len(self._leases)}

    def _describe(self, instance: Instance, now: float) -> dict[str, Any]:
        tenants = [
            {"model_id": mid, "train_mode": lease.train_mode, "idle_s": round(lease.idle_s(now), 3)}
            for mid in instance.tenants
            if (lease := self._leases.get(mid)) is not None
        ]
        return {
            "instance_id": instance.instance_id,
            "epoch": instance.spec.epoch,
            "node": instance.spec.node,
            "gpus": instance.spec.gpus,
            "train_mode": instance.spec.train_mode,
            "state": instance.state.value,
            "resident": instance.resident,
            "tenants": tenants,
            "idle_s": round(max(0.0, now - instance.last_active_at), 3),
            "cause": instance.cause,
        }

    # ---- placement (synchronous: check and claim in one step) ----------------------------------------

    def _model_for(self, base_model: str, train_mode: str, lora: LoraSpec | None) -> CatalogModel:
        model = self._models.get(base_model)
        if model is None:
            raise UnknownCatalogModel(
                f"base_model {base_model!r} is not in the catalog; use one of: {', '.join(self._models)}"
            )
        if not model.allows(train_mode):
            raise TrainModeNotAllowed(
                f"{base_model} allows train modes {', '.join(model.train_modes)}, not {train_mode!r}"
            )
        if lora is not None and lora.rank > model.max_lora_rank:
            raise TrainModeNotAllowed(
                f"LoRA rank {lora.rank} is above {base_model}'s max_lora_rank {model.max_lora_rank}"
            )
        return model

    def _place(self, model_id: str, model: CatalogModel, train_mode: str) -> Lease:
        instance = choose_instance(self.instances(), model.name, train_mode)
        if instance is None:
            instance = self._new_instance(model, train_mode, resident=False)
        instance.tenants[model_id] = train_mode
        now = self._clock()
        instance.last_active_at = now
        lease = Lease(
            model_id=model_id,
            base_model=model.name,
            train_mode=train_mode,
            instance_id=instance.instance_id,
            epoch=instance.spec.epoch,
            created_at=now,
            last_active_at=now,
            idle_timeout_s=model.idle_timeout_s,
            max_lifetime_s=model.max_lifetime_s,
        )
        self._leases[model_id] = lease
        self._receipts.forget(model_id)  # a recreated handle starts clean, not "expired"
        self._publish()
        return lease

    def _new_instance(self, model: CatalogModel, train_mode: str, resident: bool) -> Instance:
        node = self._pool.find_node(model.gpus_per_instance)
        if node is None:
            if self._metrics:
                self._metrics.rejections.labels(model.name).inc()
            raise CapacityError(model.name, train_mode, model.gpus_per_instance, self._pool.free_by_node())
        self._pool.claim(node, model.gpus_per_instance)
        self._last_epoch += 1
        epoch = self._last_epoch
        spec = InstanceSpec(
            model, instance_id_for(model.name, epoch), epoch, node, model.gpus_per_instance, train_mode
        )
        instance = Instance(spec, resident, started_at=self._clock(), last_active_at=self._clock())
        self._instances[spec.instance_id] = instance
        self._starts[spec.instance_id] = self._spawn(self._start(instance))
        if self._metrics:
            self._metrics.starts.labels(model.name).inc()
        return instance

    # ---- starting -------------------------------------------------------------------------------------

    async def _start(self, instance: Instance) -> Runtime:
        try:
            runtime = await self._backend.start(instance.spec)
        except BaseException as exc:
            cause = f"failed to start: {type(exc).__name__}: {exc}"
            if instance.state is InstanceState.STARTING:
                await self._retire(instance.instance_id, InstanceState.FAILED, cause)
            raise UnavailableError(
                f"instance {instance.instance_id} of {instance.model.name} {cause}"
            ) from exc
        instance.runtime = runtime
        if instance.state is not InstanceState.STARTING:  # retired while starting (close, quarantine)
            await self._stop(instance)
            raise UnavailableError(f"instance {instance.instance_id} {instance.cause or 'was released'}")
        instance.move(InstanceState.READY)
        self._publish()
        await self._persist()
        return runtime

    async def _started(self, instance: Instance) -> Runtime:
        """The runtime once the instance is ready: waits on the shared start (shielded, so one caller's
        cancellation does not cancel the others' start)."""
        if instance.state is InstanceState.READY and instance.runtime is not None:
            return instance.runtime
        start = self._starts.get(instance.instance_id)
        if instance.state is InstanceState.STARTING and start is not None:
            return await asyncio.shield(start)
        raise UnavailableError(f"instance {instance.instance_id} {instance.cause or instance.state.value}")

    # ---- ending ---------------------------------------------------------------------------------------

    def _end_lease(self, lease: Lease, reason: str, detail: str) -> Awaitable[None]:
        """End the lease now (synchronously) and say what must follow: reset the slot or stop the instance."""
        self._leases.pop(lease.model_id, None)
        now = self._clock()
        text = f"model {lease.model_id} ({lease.base_model}) {detail}"
        self._record(Receipt(lease.model_id, reason, text, now))
        if self._metrics and reason in ("idle", "lifetime"):
            self._metrics.expiries.labels(lease.base_model).inc()
        instance = self._instances.get(lease.instance_id)
        self._publish()
        if instance is None or instance.tenants.pop(lease.model_id, None) is None:
            return _done()
        instance.last_active_at = now
        if instance.state not in (InstanceState.STARTING, InstanceState.READY):
            return _done()  # it is being retired already
        if not instance.resident and not instance.tenants and instance.state is InstanceState.READY:
            instance.move(InstanceState.RELEASING)
            return self._stop(instance)
        # Otherwise (a resident, peers remain, or it is still starting): reset the slot, then see.
        hold = RESET_PREFIX + lease.model_id
        instance.tenants[hold] = lease.train_mode  # nobody joins the slot until its state is reset
        return self._reset_slot(instance, lease.model_id, hold)

    async def _reset_slot(self, instance: Instance, model_id: str, hold: str) -> None:
        try:
            runtime = await self._started(instance)
            await runtime.release_model(model_id)  # LoRA: RemoveAdapter; full: weights back to the base
        except Exception as exc:  # a slot that could not be reset cannot be trusted with a new tenant
            instance.tenants.pop(hold, None)
            if instance.state is InstanceState.READY:
                await self.quarantine(instance.instance_id, f"resetting {model_id}'s state failed: {exc}")
            return
        instance.tenants.pop(hold, None)
        if not instance.resident and not instance.tenants and instance.state is InstanceState.READY:
            instance.move(InstanceState.RELEASING)
            await self._stop(instance)

    async def _retire(self, instance_id: str, state: InstanceState, cause: str) -> None:
        """Quarantine or fail an instance: end its tenants' leases naming `cause`, stop it, and restart a
        resident one under a new epoch (a resident that died marks the job unhealthy instead)."""
        instance = self._instances.get(instance_id)
        if instance is None or state not in _RETIRABLE.get(instance.state, ()):
            return
        instance.move(state)
        instance.cause = cause
        for model_id in [m for m in instance.tenants if not m.startswith(RESET_PREFIX)]:
            lease = self._leases.pop(model_id, None)
            if lease is not None:
                text = f"model {model_id} ({lease.base_model}) ended: its instance {instance_id} {cause}"
                self._record(Receipt(model_id, "instance_lost", text, self._clock()))
        instance.tenants.clear()
        instance.move(InstanceState.RELEASING)
        self._publish()
        replacement = None
        if instance.resident and state is InstanceState.QUARANTINED:
            await self._stop(instance)  # free its GPUs first: the replacement needs them
            try:
                replacement = self._new_instance(instance.model, resident_mode(instance), resident=True)
            except CapacityError as exc:  # its stop failed: the GPUs are not back yet
                self._resident_failure = f"resident {instance.model.name} could not restart: {exc}"
        elif instance.resident:
            self._resident_failure = f"resident instance {instance_id} of {instance.model.name} {cause}"
        await self._persist()
        if replacement is None:
            await self._stop(instance)
        else:
            await asyncio.gather(self._starts[replacement.instance_id], return_exceptions=True)

    async def _stop(self, instance: Instance) -> None:
        """RELEASING -> RELEASED once the backend stopped it; only then do its GPUs return to the pool.
        A failed stop leaves it RELEASING (GPUs still counted); expire_idle retries."""
        if instance.state is not InstanceState.RELEASING or instance.stopping:
            return
        instance.stopping = True
        try:
            await self._backend.stop(instance.spec)
        except Exception as exc:
            instance.cause = f"{instance.cause or 'release'}; stop failed: {exc}"
            log.warning("catalog: stopping %s failed (will retry): %s", instance.instance_id, exc)
            return
        finally:
            instance.stopping = False
        instance.move(InstanceState.RELEASED)
        self._pool.free(instance.spec.node, instance.spec.gpus)
        self._instances.pop(instance.instance_id, None)
        self._starts.pop(instance.instance_id, None)
        if self._metrics:
            self._metrics.releases.labels(instance.model.name).inc()
        self._publish()
        await self._persist()

    # ---- leases ---------------------------------------------------------------------------------------

    def _live_lease(self, model_id: str) -> Lease:
        """The handle's lease; an ended one raises its receipt's error; one past its limits ends now."""
        now = self._clock()
        lease = self._leases.get(model_id)
        if lease is None:
            receipt = self._receipts.get(model_id, now)
            if receipt is not None:
                raise HandleExpired(f"{receipt.detail}; create a new model to continue")
            raise NotFoundError(f"model {model_id} has no catalog handle (never created, or long ended)")
        reason = lease.expiry(now)
        if reason is not None:
            self._spawn(self._finish(self._end_lease(lease, reason, expiry_text(lease, reason))))
            raise HandleExpired(
                f"model {model_id} ({lease.base_model}) {expiry_text(lease, reason)}; create a new model"
            )
        return lease

    async def _finish(self, follow_up: Awaitable[None]) -> None:
        await self._persist()
        await follow_up

    # ---- persistence and recovery ---------------------------------------------------------------------

    def _document(self) -> dict[str, Any]:
        return {
            "version": 1,
            "writer": self._writer,
            "last_epoch": self._last_epoch,
            "instances": [i.to_json() for i in self._instances.values()],
            "leases": [lease.to_json() for lease in self._leases.values()],
        }

    def _record(self, receipt: Receipt) -> None:
        self._receipts.record(receipt)
        if self._stored_receipts is not None:
            self._unsaved_receipts.append(receipt)

    async def _persist(self) -> None:
        if self._store is None:
            return
        async with self._persist_lock:  # the document is built inside: the last write is the newest state
            await self._store.update(STATE_NS, STATE_KEY, self._unless_superseded)
            if self._stored_receipts is not None:
                unsaved, self._unsaved_receipts = self._unsaved_receipts, []
                try:
                    await self._stored_receipts.save(unsaved)
                except BaseException:  # a store outage: the next _persist writes them, not never
                    self._unsaved_receipts[:0] = unsaved
                    raise

    def _unless_superseded(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        """The new document, unless another controller has taken the state over (its recover() ran
        since): then this one is stale, and its books must not overwrite the live controller's."""
        writer = (stored or {}).get("writer")
        if writer not in (None, self._writer):
            raise ControllerSuperseded(
                f"another catalog controller ({writer}) took over the allocation state; this one "
                f"({self._writer}) stopped writing: restart the gateway that runs it"
            )
        return self._document()

    async def recover(self) -> None:
        """Rebuild the books from the store after a restart (call before start_residents): instances
        whose actors are gone are stopped; live ones are re-adopted when the backend can (an `adopt`
        method), else stopped; an instance is never counted twice; leases on stopped ones end."""
        if self._store is None:
            return
        taken: list[dict[str, Any] | None] = []

        def take_over(stored: dict[str, Any] | None) -> dict[str, Any] | None:
            taken[:] = [stored]  # the store may call this more than once (a retried atomic update)
            return None if stored is None else {**stored, "writer": self._writer}

        await self._store.update(STATE_NS, STATE_KEY, take_over)
        if self._stored_receipts is not None:  # handles that ended before the restart still say why
            for receipt in await self._stored_receipts.load(self._clock()):
                self._receipts.record(receipt)
        document = taken[0] if taken else None
        if not document:
            return
        self._last_epoch = max(self._last_epoch, int(document["last_epoch"]))
        leases = [Lease.from_json(item) for item in document["leases"]]
        for item in document["instances"]:
            await self._recover_instance(
                item, [lease for lease in leases if lease.instance_id == item["instance_id"]]
            )
        self._publish()
        await self._persist()

    async def _recover_instance(self, item: dict[str, Any], leases: list[Lease]) -> None:
        model = self._models.get(item["model"])
        instance_id = item["instance_id"]
        if instance_id in self._instances:  # already in the books: recovering twice changes nothing
            return
        stored_model = CatalogModel(
            **{**item["model_entry"], "train_modes": tuple(item["model_entry"]["train_modes"])}
        )
        spec = InstanceSpec(
            model or stored_model,
            instance_id,
            item["epoch"],
            item["node"],
            item["gpus"],
            item.get("train_mode") or default_mode(model or stored_model),
        )
        runtime = None
        if model is not None and item["state"] == InstanceState.READY.value:
            runtime = await self._adopt(spec, [lease.model_id for lease in leases])
        if runtime is None or self._pool.free_by_node().get(spec.node, 0) < spec.gpus:
            await self._backend.stop(spec)  # a model no longer in the catalog is stopped by its stored entry
            for lease in leases:
                text = (
                    f"model {lease.model_id} ({lease.base_model}) ended: its instance was lost in a restart"
                )
                self._record(Receipt(lease.model_id, "instance_lost", text, self._clock()))
            return
        self._pool.claim(spec.node, spec.gpus)
        instance = Instance(spec, bool(item["resident"]), InstanceState.READY, started_at=item["started_at"])
        instance.runtime = runtime
        instance.last_active_at = max([lease.last_active_at for lease in leases], default=self._clock())
        for lease in leases:
            instance.tenants[lease.model_id] = lease.train_mode
            self._leases[lease.model_id] = lease
        self._instances[instance_id] = instance

    async def _adopt(self, spec: InstanceSpec, model_ids: list[str]) -> Runtime | None:
        backend = self._backend
        if not isinstance(backend, AdoptingBackend) or not await backend.alive(spec):
            return None
        return await backend.adopt(spec, model_ids)

    # ---- housekeeping ---------------------------------------------------------------------------------

    def _publish(self) -> None:
        if self._metrics is None:
            return
        states = [(i.model.name, i.state.value) for i in self._instances.values()]
        handles = [lease.base_model for lease in self._leases.values()]
        self._metrics.set_books(self._models, states, handles, self._pool.free_total())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))
        return task

    async def close(self) -> None:
        """Stop every instance (job end): starts in flight are cancelled, then everything is stopped."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for instance in self.instances():
            if instance.state in HOLDS_GPUS and instance.state is not InstanceState.RELEASING:
                if instance.state is InstanceState.STARTING:
                    instance.move(InstanceState.FAILED)
                instance.move(InstanceState.RELEASING)
            await self._stop(instance)


_RETIRABLE: dict[InstanceState, tuple[InstanceState, ...]] = {
    InstanceState.STARTING: (InstanceState.FAILED,),
    InstanceState.READY: (InstanceState.QUARANTINED, InstanceState.FAILED),
}


async def _done() -> None:
    return None


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def forget(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("catalog background task ended: %s", task.exception())

    return forget
