"""The model catalog's Prometheus metrics (docs/catalog.md): registered on the job's registry so the
gateway's /metrics shows them. The controller counts events; gauges are set from its books."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

INSTANCE_STATES = ("starting", "ready", "quarantined", "failed", "releasing")


class CatalogMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model"], registry=registry)

        self.instances = Gauge(
            "miles_catalog_instances", "Catalog instances by model and state", ["model", "state"],
            registry=registry,
        )  # fmt: skip
        self.free_gpus = Gauge(
            "miles_catalog_free_gpus", "GPUs of the pool no instance holds", registry=registry
        )
        self.handles = Gauge(
            "miles_catalog_handles", "Tenant handles (leases) by model", ["model"], registry=registry
        )
        self.starts = counter("miles_catalog_instance_starts", "Instances started")
        self.releases = counter(
            "miles_catalog_instance_releases", "Instances released (GPUs back in the pool)"
        )
        self.rejections = counter("miles_catalog_capacity_rejections", "Handle requests refused: no capacity")
        self.expiries = counter("miles_catalog_handle_expiries", "Handles ended by idle timeout or lifetime")

    def set_books(
        self,
        models: Iterable[str],
        instance_states: list[tuple[str, str]],
        handles: list[str],
        free_gpus: int,
    ) -> None:
        """Set every gauge from the controller's books: (model, state) per instance, model per handle."""
        for model in models:
            for state in INSTANCE_STATES:
                self.instances.labels(model, state).set(instance_states.count((model, state)))
            self.handles.labels(model).set(handles.count(model))
        self.free_gpus.set(free_gpus)
