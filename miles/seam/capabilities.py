"""What a Runtime may do beyond the protocol every runtime implements, one protocol per capability.

A runtime declares a capability by inheriting its protocol (CatalogRuntime, RayRuntime, the metered
wrapper); the gateway asks for it through the helpers in miles.seam.runtime, which test `isinstance`
against these protocols and treat a runtime without one as lacking the capability. Each protocol holds
the methods that only make sense together (a sampling lane and its timeout), so a runtime (or a test
double) offering part of one capability offers all of that part and nothing it cannot answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: miles.seam.runtime imports this module
    from miles.seam.runtime import SamplerTarget


@runtime_checkable
class OperationTimeouts(Protocol):
    """Hears that the gateway's execution timeout cut an operation on a model (the operation is cancelled
    already): a catalog job quarantines the handle's instance. Must not block (schedule the work)."""

    def operation_timed_out(self, model_id: str, operation: str, cause: str) -> None: ...


@runtime_checkable
class SamplingLanes(Protocol):
    """Samples run on several sets of engines (a catalog job: one per instance). The gateway's
    max_concurrent_samples applies per lane, and a sample cut at its execution timeout names its lane,
    since samples carry no model id. `sampling_lane_timed_out` must not block."""

    def sampling_lane(self, target: SamplerTarget) -> str: ...

    def sampling_lane_timed_out(self, lane: str, cause: str) -> None: ...


@runtime_checkable
class ElasticTraining(Protocol):
    """Elastic hybrid training (docs/elastic.md): the runtime reads the gateway's count of queued
    training operations to decide when to borrow, and reports its lanes and GPU owners (None while
    elastic training is off)."""

    def watch_training_queue(self, waiting: Callable[[], int]) -> None: ...

    def elastic_status(self) -> dict[str, Any] | None: ...


@runtime_checkable
class ModelCatalog(Protocol):
    """The runtime's model catalog as plain data (models, instances, tenants, the free pool): the shape
    of `miles.catalog.controller.CatalogController.snapshot`, documented in docs/catalog.md. None: no
    catalog behind it (a wrapper over a runtime of one model)."""

    def catalog(self) -> dict[str, Any] | None: ...


@runtime_checkable
class ServingDegradation(Protocol):
    """What keeps part of a live job from serving as it should (an engine failed and respawning, colocated
    GPUs left unsettled by a failed switch): healthz answers 200 `"status": "degraded"` with it, so an
    operator sees it and the watchdog does not end the job. None: nothing is wrong."""

    def degradation(self) -> str | None: ...
