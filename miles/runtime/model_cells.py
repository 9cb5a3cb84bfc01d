"""One model's cells in one placement group: the trainer cell, its engine cells, and the RayRuntime over them.

The one bring-up both paths share: the job's resident model (`miles.driver.bringup`, one group over every
node) and a catalog instance started on demand (`miles.runtime.instances`, one single-node STRICT_PACK
group). Starting is all or nothing: when either side fails, what did start is stopped before the error
propagates, so the caller only ever owns cells that are up.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.util.placement_group import PlacementGroup

from miles.cluster.named import InstanceNames
from miles.contract.preset.model import ParallelLayout
from miles.engines.config import EngineConfig
from miles.rollout.controller import InferenceController
from miles.rollout.engine_cell import EngineCell, engine_cells_for
from miles.runtime.colocation import ColocationPlan
from miles.runtime.layout import Layout
from miles.runtime.ray_runtime import RayRuntime
from miles.seam.runtime import ModelCard
from miles.train.cell import TrainerCell
from miles.train.controller import TrainerController
from miles.weights.push import PushConfig


@dataclass(frozen=True)
class CellSettings:
    """What the trainer and engine cells of one model start with."""

    model_dir: Path
    train_mode: str  # "lora" | "full"
    engine: EngineConfig
    trainer_dtype: str
    max_batch_tokens: int | None  # None: no budget
    torch_threads: int = 1
    log_dir: Path | None = None
    backend: str = "transformers"  # model.backend
    parallel: ParallelLayout | None = None  # model.parallel (megatron only)
    trainer_channel: bool = True  # runtime.trainer_channel: commands over miles.train.channel
    colocate: bool = False  # colocate.enabled: trainer rank i and engine i share bundle i's GPU

    @property
    def bundle_share(self) -> float:
        """What each actor asks of its bundle (one GPU, its CPUs): all of it, or half when a trainer rank
        and an engine share it (Ray only books; the GPU's memory is shared by releasing and offloading,
        docs/colocation.md)."""
        return 0.5 if self.colocate else 1.0

    def backend_kwargs(self) -> dict[str, Any]:
        """What the trainer ranks need beyond the defaults: the megatron backend and its parallel sizes."""
        if self.backend == "transformers":
            return {}
        parallel = self.parallel.model_dump() if self.parallel is not None else {}
        return {"backend": self.backend, "parallel": parallel}


@dataclass
class ModelCells:
    """The started cells of one model (the placement group belongs to the caller)."""

    trainer_cell: TrainerCell
    trainer: TrainerController
    engines: list[EngineCell]
    inference: InferenceController

    async def stop(self) -> None:
        """Stop the engine processes and the trainer actors (idempotent; each side bounded by its cell)."""
        await asyncio.gather(self.inference.stop(), self.trainer.stop(), return_exceptions=True)


def _trainer_cell(settings: CellSettings, names: InstanceNames | None) -> TrainerCell:
    return TrainerCell(
        0,
        num_gpus_per_actor=settings.bundle_share,
        num_cpus_per_actor=settings.bundle_share,
        torch_threads=settings.torch_threads,
        names=names,
        command_channel=settings.trainer_channel,
    )


async def start_model_cells(
    pg: PlacementGroup, layout: Layout, settings: CellSettings, names: InstanceNames | None = None
) -> ModelCells:
    """Engine cells and the trainer cell side by side on `layout`'s bundles of `pg`; `names`: their
    actors get stable names (miles.cluster.named), so a restarted driver can re-adopt them."""
    engines = engine_cells_for(pg, layout.engines, settings.engine, names, bundle_share=settings.bundle_share)
    inference = InferenceController(engines)
    cell = _trainer_cell(settings, names)
    cells = ModelCells(cell, TrainerController([cell]), engines, inference)
    try:
        await asyncio.gather(
            inference.start(),
            cell.start(
                [(pg, bundle.bundle_index) for bundle in layout.trainer],
                model_path=str(settings.model_dir),
                train_mode=settings.train_mode,
                dtype=settings.trainer_dtype,
                max_batch_tokens=settings.max_batch_tokens,
                log_dir=str(settings.log_dir) if settings.log_dir else None,
                **settings.backend_kwargs(),
            ),
        )
    except BaseException:
        await asyncio.shield(cells.stop())
        raise
    return cells


async def adopt_model_cells(
    pg: PlacementGroup, settings: CellSettings, names: InstanceNames, trainers: list[Any], engines: list[Any]
) -> ModelCells:
    """Cells over actors another driver started in `pg` (trainer ranks in rank order, engine actors in
    index order): each engine respawns where it was (its bundle and GPUs, which its actor reports).
    All or nothing, like start_model_cells: a failure stops what was taken over."""
    placements = await asyncio.gather(*(actor.placement.remote() for actor in engines))
    cells = [
        EngineCell(
            i,
            settings.engine,
            (pg, index) if index is not None else None,
            gpu_ids=gpus,
            names=names,
            bundle_share=settings.bundle_share,
        )
        for i, (index, gpus) in enumerate(placements)
    ]
    cell = _trainer_cell(settings, names)
    adopted = ModelCells(cell, TrainerController([cell]), cells, InferenceController(cells))
    try:
        await asyncio.gather(cell.adopt(trainers), *(c.adopt(a) for c, a in zip(cells, engines, strict=True)))
    except BaseException:
        await asyncio.shield(adopted.stop())
        raise
    return adopted


async def serve_model_cells(
    card: ModelCard,
    cells: ModelCells,
    *,
    push: PushConfig,
    max_loaded_adapters: int,
    lora_batch_window_s: float,
    colocation: ColocationPlan | None = None,
) -> RayRuntime:
    """The RayRuntime over started cells, once the engines hold their first weights. `lora_batch_window_s`:
    the preset's (miles.contract.preset.lora_batch_window_ms / 1000); no default, so no caller drops it."""
    runtime = RayRuntime(
        card,
        cells.trainer,
        cells.inference,
        push=push,
        max_loaded_adapters=max_loaded_adapters,
        lora_batch_window_s=lora_batch_window_s,
        colocation=colocation,
    )
    await runtime.publish_initial_weights()
    cells.inference.start_health_checks()
    return runtime
