"""RayInstanceBackend: the catalog's instances on the job's Ray cluster (miles.catalog.api.InstanceBackend).

An instance is one STRICT_PACK placement group of `gpus` GPU bundles pinned to `spec.node`, holding the
model's trainer cell (its first bundles) and engine cell(s) (its last ones), started by the same
`start_model_cells` / `serve_model_cells` as the job's resident model, and the RayRuntime over them.

Stopping is bounded and complete: engine processes and actors are stopped, the group is removed, and
`stop` returns once Ray reports the group REMOVED (its GPUs are free again) or the bound passes.
Only the catalog controller calls this; it alone decides which instance starts where.

Recoverable (a `namespace` given, for jobs whose catalog books live in Redis): every instance's group and
actors are named in that Ray namespace (miles.cluster.named) and detached, so they outlive a driver that
dies. A restarted driver's controller then asks `alive` and `adopt` by name (the cells and the RayRuntime
are rebuilt over the same actors, tenants' state intact), or `stop`, which kills whatever of the instance
is left and removes its group. Detached means nothing dies with the driver: `close` (job end) stops every
instance, and the job's teardown stops Ray itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from miles.catalog.api import AdoptingBackend, InstanceBackend, InstanceSpec
from miles.cluster.named import DETACHED, InstanceNames, find_placement_group
from miles.cluster.placement import create_single_node_placement_group, locate_bundles
from miles.cluster.ray_setup import alive_nodes, head_node_ip
from miles.contract.catalog import CatalogModel, PoolNode
from miles.contract.roles import plan_from_ips
from miles.runtime.layout import plan_layout
from miles.runtime.model_cells import (
    CellSettings,
    ModelCells,
    adopt_model_cells,
    serve_model_cells,
    start_model_cells,
)
from miles.runtime.model_config import model_arch
from miles.runtime.ray_runtime import RayRuntime
from miles.seam.runtime import ModelCard, Runtime
from miles.weights.push import PushConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # cells' own stops are bounded (engine 15 s); this bounds the whole instance
PG_REMOVED_POLL_S = 0.05


@dataclass(frozen=True)
class InstanceRecipe:
    """How one catalog model's instances start: its card and its cells' settings (train mode included)."""

    card: ModelCard
    settings: CellSettings
    tp_size: int = 1


@dataclass
class RunningInstance:
    spec: InstanceSpec
    pg: PlacementGroup
    cells: ModelCells
    runtime: RayRuntime


def instance_train_mode(spec: InstanceSpec) -> str:
    """The mode the instance's trainer loads: the spec's when it names one, else the model's only mode."""
    if spec.train_mode:
        return spec.train_mode
    if len(spec.model.train_modes) == 1:
        return spec.model.train_modes[0]
    raise ValueError(
        f"catalog model {spec.model.name!r} allows {list(spec.model.train_modes)}; "
        f"instance {spec.instance_id} must say which one it trains"
    )


def safe_dir_name(instance_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", instance_id).strip("-") or "instance"


def pool_from_nodes(nodes: list[dict], head_ip: str | None) -> list[PoolNode]:
    """Pure: Ray's alive nodes -> pool nodes with GPUs, by IP (ordered by IP, the head last)."""
    gpus: dict[str, int] = {}
    for node in nodes:
        ip = node["NodeManagerAddress"]
        gpus[ip] = gpus.get(ip, 0) + int(node.get("Resources", {}).get("GPU", 0))
    ordered = sorted((ip for ip, count in gpus.items() if count > 0), key=lambda ip: (ip == head_ip, ip))
    return [PoolNode(node=ip, gpus=gpus[ip], is_head=ip == head_ip) for ip in ordered]


class RayInstanceBackend(InstanceBackend, AdoptingBackend):
    def __init__(
        self,
        recipe_for: Callable[[CatalogModel], InstanceRecipe],
        *,
        push: PushConfig,
        lora_batch_window_s: float,
        max_loaded_adapters: int = 16,
        placement_timeout_s: float = 60.0,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        cpus_per_bundle: float = 1,
        namespace: str | None = None,
    ) -> None:
        self._recipe_for = recipe_for
        self._namespace = namespace  # set: instances are named and detached there (recoverable)
        self._push = push
        self.lora_batch_window_s = lora_batch_window_s  # every instance's coalescer (the preset's window)
        self._max_loaded_adapters = max_loaded_adapters
        self._placement_timeout_s = placement_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._cpus_per_bundle = cpus_per_bundle
        self._running: dict[str, RunningInstance] = {}

    def pool_nodes(self) -> list[PoolNode]:
        return pool_from_nodes(alive_nodes(), head_node_ip())

    def running(self) -> dict[str, RunningInstance]:
        """The instances this backend started and has not stopped, by instance id."""
        return dict(self._running)

    async def start(self, spec: InstanceSpec) -> Runtime:
        recipe = self._recipe_for(spec.model)
        settings = self._instance_settings(recipe.settings, spec)
        names = self.names(spec.instance_id)
        pg = await create_single_node_placement_group(
            spec.gpus,
            cpus_per_bundle=self._cpus_per_bundle,
            timeout_s=self._placement_timeout_s,
            name=names.group_name() if names else f"miles-{safe_dir_name(spec.instance_id)}",
            node_ip=spec.node,
            lifetime=DETACHED if names else None,
        )
        cells: ModelCells | None = None
        try:
            layout = await self._layout(pg, spec, recipe.tp_size)
            cells = await start_model_cells(pg, layout, settings, names)
            card = dataclasses.replace(recipe.card, train_mode=settings.train_mode)
            runtime = await self._serve(card, cells)
        except BaseException:
            try:
                await asyncio.shield(self._teardown(spec.instance_id, pg, cells))
            except Exception as exc:  # the start's own error is the one to report
                log.warning("instance %s: cleanup after a failed start: %s", spec.instance_id, exc)
            raise
        self._running[spec.instance_id] = RunningInstance(spec, pg, cells, runtime)
        log.info(
            "instance %s up on %s (%d GPUs, epoch %d)", spec.instance_id, spec.node, spec.gpus, spec.epoch
        )
        return runtime

    async def stop(self, spec: InstanceSpec) -> None:
        """Stopped and its GPUs free again, or an error (the instance stays listed and the controller,
        which keeps its GPUs counted meanwhile, calls stop again)."""
        running = self._running.get(spec.instance_id)
        if running is None:
            await self._stop_leftovers(spec)  # started by a driver before a restart, or never
            return
        await self._teardown(spec.instance_id, running.pg, running.cells)
        self._running.pop(spec.instance_id, None)
        log.info("instance %s stopped; its %d GPUs are free", spec.instance_id, spec.gpus)

    async def alive(self, spec: InstanceSpec) -> bool:
        running = self._running.get(spec.instance_id)
        if running is not None:
            return await running.cells.trainer.probe_cells(timeout_s=10.0)
        found = await asyncio.to_thread(self._find, spec)
        if found is None:
            return False
        _, trainers, _ = found
        try:
            await asyncio.wait_for(asyncio.gather(*(_answer(a.ping.remote()) for a in trainers)), 10.0)
        except Exception as exc:  # gone or hung: not an instance to hand tenants back to
            log.warning("instance %s: its trainer does not answer (%s)", spec.instance_id, exc)
            return False
        return True

    async def adopt(self, spec: InstanceSpec, model_ids: list[str]) -> Runtime | None:
        """After a driver restart: the instance's runtime over its named actors, with `model_ids` (its
        tenants' handles) known to it, or None when any part of it is gone (the controller stops it)."""
        found = await asyncio.to_thread(self._find, spec)
        if found is None:
            return None
        pg, trainers, engines = found
        recipe = self._recipe_for(spec.model)
        settings = self._instance_settings(recipe.settings, spec)
        names = self.names(spec.instance_id)
        assert names is not None  # _find found named actors
        try:
            cells = await adopt_model_cells(pg, settings, names, trainers, engines)
            card = dataclasses.replace(recipe.card, train_mode=settings.train_mode)
            runtime = await self._serve(card, cells)
        except Exception as exc:
            log.warning("instance %s: could not re-adopt it (%s); it will be stopped", spec.instance_id, exc)
            return None
        runtime.adopt_models(model_ids)
        self._running[spec.instance_id] = RunningInstance(spec, pg, cells, runtime)
        log.info(
            "instance %s re-adopted on %s (epoch %d, %d handle(s))",
            spec.instance_id,
            spec.node,
            spec.epoch,
            len(model_ids),
        )
        return runtime

    async def _serve(self, card: ModelCard, cells: ModelCells) -> RayRuntime:
        return await serve_model_cells(
            card,
            cells,
            push=self._push,
            max_loaded_adapters=self._max_loaded_adapters,
            lora_batch_window_s=self.lora_batch_window_s,
        )

    def names(self, instance_id: str) -> InstanceNames | None:
        """Where the instance's group and actors are named (None: not recoverable, nothing named)."""
        if self._namespace is None:
            return None
        return InstanceNames(self._namespace, f"{safe_dir_name(instance_id)}/", detached=True)

    def _roles(self, spec: InstanceSpec) -> tuple[list[str], list[str]]:
        """The instance's trainer rank and engine actor roles, as start_model_cells names them."""
        engines = spec.model.engines_per_instance
        try:
            tp_size = self._recipe_for(spec.model).tp_size
        except ValueError:  # a model no longer in the catalog: its leftovers are still to be stopped
            tp_size = 1
        trainers = spec.gpus - engines * tp_size
        return [f"trainer-{r}" for r in range(trainers)], [f"engine-{i}" for i in range(engines)]

    def _find(self, spec: InstanceSpec) -> tuple[PlacementGroup, list, list] | None:
        """(group, trainer actors, engine actors) when every part of the instance is still there."""
        names = self.names(spec.instance_id)
        if names is None:
            return None
        pg = find_placement_group(names.group_name())
        trainer_roles, engine_roles = self._roles(spec)
        trainers = [names.lookup(role) for role in trainer_roles]
        engines = [names.lookup(role) for role in engine_roles]
        if pg is None or any(actor is None for actor in trainers + engines):
            return None
        return pg, trainers, engines

    async def _stop_leftovers(self, spec: InstanceSpec) -> None:
        """Kill whatever named actors of the instance are left and remove its group (a half-gone
        instance after a restart); then wait until Ray no longer holds its resources."""
        names = self.names(spec.instance_id)
        if names is None:
            return
        trainer_roles, engine_roles = self._roles(spec)
        killed = await asyncio.to_thread(lambda: [r for r in trainer_roles + engine_roles if names.kill(r)])
        pg = await asyncio.to_thread(find_placement_group, names.group_name())
        if pg is not None:
            await asyncio.to_thread(remove_placement_group, pg)
            if not await wait_removed(pg, self._stop_timeout_s):
                raise RuntimeError(f"instance {spec.instance_id}: Ray still holds its group after removal")
        if killed or pg is not None:
            log.info(
                "instance %s: removed what a previous driver left (%s)",
                spec.instance_id,
                ", ".join(killed + (["its placement group"] if pg is not None else [])),
            )

    def _instance_settings(self, settings: CellSettings, spec: InstanceSpec) -> CellSettings:
        """The model's settings with this instance's train mode and its own log directory (engine-0.log
        and trainer-rank0.log of different instances must not share a file)."""
        log_dir = settings.log_dir / safe_dir_name(spec.instance_id) if settings.log_dir else None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        engine = dataclasses.replace(settings.engine, log_dir=str(log_dir) if log_dir else None)
        return dataclasses.replace(
            settings, train_mode=instance_train_mode(spec), engine=engine, log_dir=log_dir
        )

    async def _layout(self, pg: PlacementGroup, spec: InstanceSpec, tp_size: int):
        bundles = sorted(await locate_bundles(pg), key=lambda b: (b.gpu_id, b.bundle_index))
        # one node: plan_layout gives the trainer the first bundles and the engines the last ones
        plan = plan_from_ips([spec.node], spec.node, 1)
        return plan_layout(
            bundles, plan=plan, engines_per_node=spec.model.engines_per_instance, tp_size=tp_size
        )

    async def _teardown(self, instance_id: str, pg: PlacementGroup, cells: ModelCells | None) -> None:
        deadline = time.monotonic() + self._stop_timeout_s
        if cells is not None:
            try:
                await asyncio.wait_for(cells.stop(), self._stop_timeout_s)
            except TimeoutError:  # removing the group below kills whatever is left in it
                log.warning(
                    "instance %s: cells did not stop within %.0f s", instance_id, self._stop_timeout_s
                )
        left = max(deadline - time.monotonic(), 1.0)
        await asyncio.wait_for(asyncio.to_thread(remove_placement_group, pg), left)
        if not await wait_removed(pg, max(deadline - time.monotonic(), 1.0)):
            raise RuntimeError(
                f"instance {instance_id}: Ray still holds its placement group's resources "
                f"{self._stop_timeout_s:.0f} s after the removal"
            )


async def _answer(ref) -> object:
    return await ref


async def wait_removed(pg: PlacementGroup, timeout_s: float) -> bool:
    """Until Ray's view of free resources no longer holds the group's own resources (GCS reports the
    group REMOVED before the node's report gives its GPUs back); False after `timeout_s`."""
    suffix = pg.id.hex()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = await asyncio.to_thread(ray.available_resources)
        if not any(name.endswith(suffix) for name in free):
            return True
        await asyncio.sleep(PG_REMOVED_POLL_S)
    return False


def recipe_table(recipes: dict[str, InstanceRecipe]) -> Callable[[CatalogModel], InstanceRecipe]:
    """`recipe_for` over a table built at bring-up (model name -> recipe); an unknown model says so."""

    def recipe_for(model: CatalogModel) -> InstanceRecipe:
        try:
            return recipes[model.name]
        except KeyError:
            raise ValueError(f"no instance recipe for catalog model {model.name!r}") from None

    return recipe_for


def catalog_recipe(
    model: CatalogModel, model_dir: Path, base: CellSettings, tokenizer_id: str
) -> InstanceRecipe:
    """A catalog model's recipe: the job's cell settings pointed at the model's directory, and its card
    (LoRA when the model allows it: the gateway then accepts both a rank and rank 0 where allowed)."""
    mode = "lora" if model.allows("lora") else "full"
    card = ModelCard(
        name=model.name,
        max_context=model.max_context,
        trainable=True,
        sampleable=True,
        train_mode=mode,
        tokenizer_id=tokenizer_id,
        tokenizer_path=str(model_dir),
        arch=model_arch(model_dir),
        max_lora_rank=model.max_lora_rank if mode == "lora" else None,
    )
    engine = dataclasses.replace(base.engine, model_path=str(model_dir))
    return InstanceRecipe(
        card, dataclasses.replace(base, model_dir=model_dir, train_mode=mode, engine=engine)
    )
