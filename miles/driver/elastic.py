"""Elastic training's pieces in a job (`elastic.enabled`): the core trainer cell as the core lane, the
ledger of the engines' GPUs, the ports a loan moves, the policy, and the driver that runs them."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from miles.contract.preset.runtime import ElasticOptions
from miles.elastic.driver import ElasticDriver
from miles.elastic.engine_port import EngineCellPort
from miles.elastic.lane_port import BundleLanePort
from miles.elastic.ledger import Gpu, GpuLedger
from miles.elastic.loans import EnginePort, LoanExecutor
from miles.elastic.metrics import ElasticMetrics
from miles.elastic.policy import ElasticController
from miles.elastic.routing import HybridRouter
from miles.train.hybrid.coordinator import HybridTrainer
from miles.train.hybrid.core_lane import core_lane


def engine_gpus(cell: Any) -> list[Gpu]:
    """An engine cell's GPUs in the ledger: its node (the engine's address) and GPU ids."""
    host = urlsplit(cell.client.base_url).hostname or "?"
    ids = cell.gpu_ids or (cell.bundle[1],)
    return [Gpu(host, int(i)) for i in ids]


async def start_elastic(
    settings: ElasticOptions,
    runtime: Any,
    *,
    run: str,
    model_path: str,
    lane_kwargs: dict[str, Any],
    registry: CollectorRegistry | None,
    poll_s: float = 1.0,
    drain_timeout_s: float = 30.0,
) -> ElasticDriver:
    """The driver over a RayRuntime's cells, attached to it and polling. `lane_kwargs`: what a lane's
    backend is built with beyond the model (dtype, max_batch_tokens: the core trainer's; `backend` and
    `parallel` for megatron, whose core gathers its sharded state on every rank)."""
    # every rank of the trainer cell is the core lane (rank 0 meets the lanes; docs/elastic.md)
    sharded = lane_kwargs.get("backend") == "megatron"
    core = await core_lane(runtime.trainer.alive_cell().actors, run, sharded_state=sharded)
    hybrid = HybridTrainer(run, core)
    await hybrid.start()
    inference = runtime.inference
    ledger = GpuLedger(settings.min_rollout_gpus)
    for cell in inference.cells:
        ledger.add_engine(cell.name, engine_gpus(cell))
    lanes = BundleLanePort(
        inference.cells[0].bundle[0],
        {cell.name: cell.bundle[1] for cell in inference.cells},
        run=run,
        model_path=model_path,
        train_mode=runtime.card.train_mode,
        backend_kwargs=lane_kwargs,
    )
    ports: dict[str, EnginePort] = {cell.name: EngineCellPort(inference, cell) for cell in inference.cells}
    loans = LoanExecutor(ledger, hybrid, lanes, ports, drain_timeout_s=drain_timeout_s)
    metrics = ElasticMetrics(registry) if registry is not None else None
    policy = ElasticController(settings, ledger, on_decision=metrics.count if metrics else None)
    driver = ElasticDriver(
        policy,
        loans,
        HybridRouter(runtime.trainer, hybrid),
        inference,
        runtime.train_lock,
        metrics=metrics,
        poll_s=poll_s,
    )
    if metrics is not None:
        metrics.observe_ledger(ledger)
    runtime.attach_elastic(driver)
    driver.start()
    return driver
