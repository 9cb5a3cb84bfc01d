"""CatalogRuntime: the job's Runtime when its preset has a catalog. A thin router, not a second runtime.

It owns the one catalog controller (miles.catalog.controller, the only writer of allocation state) and
sends each operation to the RayRuntime of the instance that holds the handle:

- create_model: `acquire` (starts or joins an instance; capacity errors come from there), then the
  instance's own create_model; a failure there gives the slot back.
- every training operation on a handle: `check_epoch` with the epoch the handle was admitted under (an
  instance restarted or replaced meanwhile refuses it), `touch` (business activity), then delegate.
- release_model: the instance forgets the handle, then the controller releases it (the last tenant of a
  dynamic instance stops it and frees its GPUs).
- sampling: a snapshot goes to the instance that published it while its handle lives; a LoRA snapshot
  whose handle has gone goes to any live instance of its base model (the adapter loads from disk); the
  base model goes to a live instance of it. Sampling a handle's snapshot counts as activity on it.

Quarantine: the gateway says when its execution timeout cut an operation (`operation_timed_out`, through
miles.seam.runtime.report_operation_timeout); the handle's instance is quarantined (the controller releases
a dynamic one, restarts a resident one) and its tenants get errors naming that.

Health: `probe_trainers` is what the driver's probe loop asks (miles.driver.serve.wait_for_shutdown): a
resident instance whose trainer died makes the job unhealthy (healthz 503, the job ends, as with one model); a
dynamic instance whose trainer died is quarantined, which releases it, and its tenants' operations fail
with that cause while the job serves the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from miles.catalog.controller import CatalogController
from miles.catalog.errors import UnknownCatalogModel
from miles.catalog.states import InstanceState
from miles.errors import MilesError, UnavailableError, UserError
from miles.runtime.instances import RayInstanceBackend
from miles.seam.capabilities import ModelCatalog, OperationTimeouts, SamplingLanes
from miles.seam.requests import ForwardBackwardRequest, OptimStepRequest
from miles.seam.runtime import ONE_LANE, ModelCard, Runtime, SamplerTarget, SupervisedRuntime
from miles.types import (
    ForwardBackwardOutput,
    LogprobSpec,
    LoraSpec,
    SampleChunk,
    SampleOutput,
    SamplingParams,
    TimedPart,
)

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 5.0  # how often idle handles are looked for (idle timeouts are minutes in practice)
R = TypeVar("R")


@dataclass(frozen=True)
class Published:
    """A sampler snapshot and where it was made servable."""

    model_id: str
    instance_id: str
    base_model: str
    runtime: Runtime
    lora: bool


class CatalogRuntime(SupervisedRuntime, OperationTimeouts, SamplingLanes, ModelCatalog):
    def __init__(
        self,
        controller: CatalogController,
        backend: RayInstanceBackend,
        cards: Mapping[str, ModelCard],
        *,
        reap_interval_s: float = REAP_INTERVAL_S,
    ) -> None:
        self.controller = controller
        self.backend = backend
        self._cards = dict(cards)
        self._epochs: dict[str, int] = {}  # model_id -> the epoch its handle was admitted under
        self._published: dict[str, Published] = {}  # resolved snapshot path -> where it is served
        self._reap_interval_s = reap_interval_s
        self._reaper: asyncio.Task[None] | None = None
        self._quarantines: set[asyncio.Task[None]] = set()
        # instance id -> cause, from a timeout signal until the controller has retired the instance: its
        # handles' next operations (maybe already queued behind the cut one) must not reach it meanwhile
        self._cut: dict[str, str] = {}

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resident instances up, then the idle reaper."""
        await self.controller.start_residents()
        self._reaper = asyncio.create_task(self._reap_forever(), name="catalog-idle-reaper")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval_s)
            try:
                expired = await self.controller.expire_idle()
            except Exception:
                log.exception("idle reaper failed; trying again in %.0f s", self._reap_interval_s)
                continue
            for model_id in expired:
                self._epochs.pop(model_id, None)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*self._quarantines, return_exceptions=True)
        await self.controller.close()

    def health_problem(self) -> str | None:
        return self.controller.health_problem()

    async def probe_trainers(self, timeout_s: float) -> bool:
        """Probe every ready instance (the backend bounds each probe itself): a dead dynamic instance is
        released with the cause; False once a resident one is dead."""
        dead = await self.controller.check_health()
        for instance_id in dead:
            log.error("catalog instance %s died; its tenants' operations fail with that cause", instance_id)
        return self.health_problem() is None

    def trainer_liveness(self) -> list[tuple[int, bool]]:
        """The resident instances' trainer cells: only their deaths end the job."""
        running = self.backend.running().values()
        return [
            (cell.index, cell.is_alive)
            for r in running
            if r.spec.model.resident
            for cell in r.cells.trainer.cells
        ]

    def catalog(self) -> dict[str, Any]:
        return self.controller.snapshot()

    # ---- catalogue ----------------------------------------------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        return [self._cards[model.name] for model in self.controller.models() if model.name in self._cards]

    # ---- handles ------------------------------------------------------------------------------------

    async def create_model(self, model_id: str, base_model: str, lora: LoraSpec | None) -> None:
        if model_id in self._epochs:
            return
        mode = "lora" if lora is not None else "full"
        acquired = await self.controller.acquire(model_id, base_model, mode, lora)
        try:
            await acquired.runtime.create_model(model_id, base_model, lora)
        except BaseException:
            await asyncio.shield(self.controller.release(model_id))
            raise
        self._epochs[model_id] = acquired.epoch

    def _route(self, model_id: str) -> Runtime:
        """The handle's instance runtime, if the handle is live and its instance is the one it joined."""
        cut = next((i for i in self._cut if model_id in self._tenants_of(i)), None)
        if cut is not None:
            raise UnavailableError(
                f"model {model_id}: its instance {cut} is being quarantined: {self._cut[cut]}"
            )
        epoch = self._epochs.get(model_id)
        if epoch is None:  # not created through this router (a recovered handle): its current epoch
            _, epoch = self.controller.handle_runtime(model_id)
        try:
            runtime = self.controller.check_epoch(model_id, epoch)
        except Exception:
            self._epochs.pop(model_id, None)
            raise
        self.controller.touch(model_id)
        return runtime

    async def release_model(self, model_id: str) -> None:
        """The controller resets the handle's slot (the instance's own release_model) or, for the last
        tenant of a dynamic instance, stops the instance."""
        self._epochs.pop(model_id, None)
        await self.controller.release(model_id)

    # ---- training -----------------------------------------------------------------------------------

    async def _run(self, model_id: str, call: Callable[[Runtime], Awaitable[R]]) -> R:
        """`call` on the handle's instance (see `operation_timed_out` for one that never ends)."""
        return await call(self._route(model_id))

    def operation_timed_out(self, model_id: str, operation: str, cause: str) -> None:
        """The gateway's execution timeout cut `operation` on `model_id` (the gateway knows; nothing here
        guesses from elapsed time). Whatever the instance is stuck in, no new work goes there: it is
        marked cut at once (its handles' next operations, maybe queued right behind this one, are refused
        naming the cause), and the controller quarantines it (ends its handles, stops or restarts it)."""
        instance_id = next(
            (i.instance_id for i in self.controller.instances() if model_id in i.tenants), None
        )
        if instance_id is None:  # a create cut while starting gave its slot back; an ended handle
            log.warning("%s on %s timed out; its handle holds no instance to quarantine", operation, model_id)
            return
        self._cut_instance(instance_id, cause)

    def sampling_lane_timed_out(self, lane: str, cause: str) -> None:
        """The gateway's execution timeout cut a sample on lane `lane` (`sampling_lane`: the instance it
        was admitted to; samples carry no model id). That instance is quarantined as for a training
        operation: its engines hung, so nothing new goes there."""
        if lane not in {i.instance_id for i in self.controller.instances()}:
            # ONE_LANE (nothing could serve the target), or an instance released meanwhile
            log.warning("a sample on lane %r timed out; no instance of that id to quarantine", lane)
            return
        self._cut_instance(lane, cause)

    def _cut_instance(self, instance_id: str, cause: str) -> None:
        """Refuse the instance at once (`_cut`), and have the controller quarantine it."""
        if instance_id in self._cut:  # a quarantine is under way already (several operations hung)
            return
        log.error("quarantining instance %s: %s", instance_id, cause)
        self._cut[instance_id] = cause
        task = asyncio.get_running_loop().create_task(self.controller.quarantine(instance_id, cause))
        self._quarantines.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._quarantines.discard(task)
            self._cut.pop(instance_id, None)  # the controller's receipts name the cause from now on

        task.add_done_callback(done)

    def _tenants_of(self, instance_id: str) -> set[str]:
        return next(
            (set(i.tenants) for i in self.controller.instances() if i.instance_id == instance_id), set()
        )

    async def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        return await self._run(request.model_id, lambda r: r.forward_backward(request))

    async def optim_step(self, request: OptimStepRequest) -> dict[str, float]:
        return await self._run(request.model_id, lambda r: r.optim_step(request))

    async def save_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        await self._run(model_id, lambda r: r.save_state(model_id, path, with_optimizer))

    async def load_state(self, model_id: str, path: Path, with_optimizer: bool) -> None:
        await self._run(model_id, lambda r: r.load_state(model_id, path, with_optimizer))

    async def save_for_sampler(self, model_id: str, path: Path) -> Awaitable[None] | None:
        return await self._run(model_id, lambda r: r.save_for_sampler(model_id, path))

    async def save_external(self, model_id: str, path: Path) -> None:
        await self._run(model_id, lambda r: r.save_external(model_id, path))

    async def publish_sampler(self, model_id: str, target: SamplerTarget) -> Sequence[TimedPart] | None:
        runtime = self._route(model_id)
        timeline = await runtime.publish_sampler(model_id, target)
        key = target.snapshot_key()  # the directory, or an ephemeral snapshot's id
        running = next((r for r in self.backend.running().values() if r.runtime is runtime), None)
        if key is not None and running is not None:  # None: released while publishing, nothing serves it
            lora = running.runtime.card.train_mode == "lora"
            published = Published(model_id, running.spec.instance_id, target.base_model, runtime, lora)
            self._published[key] = published
        return timeline

    # ---- sampling -----------------------------------------------------------------------------------

    def _live_instances(self, base_model: str) -> list[Runtime]:
        """Runtimes of the running instances of `base_model` that accept work, LoRA ones first (a full
        instance may serve a tenant's trained weights rather than the base)."""
        serving = {
            i.instance_id
            for i in self.controller.instances()
            if i.state is InstanceState.READY and i.instance_id not in self._cut
        }
        runtimes = [
            running.runtime
            for instance_id, running in self.backend.running().items()
            if running.spec.model.name == base_model and instance_id in serving
        ]
        return sorted(runtimes, key=lambda r: r.card.train_mode != "lora")

    def _sampling_runtime(self, target: SamplerTarget) -> Runtime:
        if target.base_model not in self._cards:
            raise UnknownCatalogModel(f"base model {target.base_model!r} is not in this job's catalog")
        key = target.snapshot_key()
        if key is not None:
            published = self._published.get(key)
            if published is not None:
                with contextlib.suppress(Exception):
                    runtime = self._route(published.model_id)
                    if runtime is published.runtime:
                        return runtime
                if not published.lora:
                    raise UserError(
                        f"sampler snapshot {target.snapshot_id or target.snapshot_path} was served by "
                        f"instance {published.instance_id}, which has been released; full-weight snapshots "
                        "are served only by the instance that made them: load the weights into a new "
                        "training client and save for the sampler again"
                    )
            if target.ephemeral:  # no files another instance could load
                raise UserError(
                    f"sampler snapshot {target.snapshot_id} is stale: it was the weights of an unnamed "
                    "save, which no instance serves now; call save_weights_for_sampler again"
                )
        live = self._live_instances(target.base_model)
        if not live:
            raise UserError(
                f"no instance of {target.base_model!r} is running; create a training client for it "
                "(which starts one), then sample"
            )
        return live[0]

    def sampling_lane(self, target: SamplerTarget) -> str:
        """The instance a sample of `target` runs on now: the gateway's sampling slots are per instance, so
        one instance's backlog never holds back another's. A target nothing can serve shares one lane (its
        sample fails with the reason anyway)."""
        try:
            runtime = self._sampling_runtime(target)
        except MilesError:
            return ONE_LANE
        return next((iid for iid, r in self.backend.running().items() if r.runtime is runtime), ONE_LANE)

    async def sample(
        self,
        target: SamplerTarget,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int,
        logprobs: LogprobSpec,
    ) -> SampleOutput:
        runtime = self._sampling_runtime(target)
        return await runtime.sample(target, prompt, params, num_samples, logprobs)

    async def stream_sample(
        self, target: SamplerTarget, prompt: list[int], params: SamplingParams, num_samples: int
    ) -> AsyncGenerator[SampleChunk, None]:
        runtime = self._sampling_runtime(target)
        async for chunk in runtime.stream_sample(target, prompt, params, num_samples):
            yield chunk
