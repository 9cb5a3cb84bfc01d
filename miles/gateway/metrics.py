"""Prometheus metrics on the gateway's own registry (so several apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from miles.observability.metrics import job_metrics


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "miles_gateway_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.operations = Counter(
            "miles_gateway_operations", "Operations finished", ["kind", "outcome"], registry=self.registry
        )
        self.op_seconds = Histogram(
            "miles_gateway_operation_seconds", "Operation execution time", ["kind"], registry=self.registry
        )
        self.deduplicated = Counter(
            "miles_gateway_deduplicated_submits",
            "Submits answered with an earlier request_id",
            ["kind"],
            registry=self.registry,
        )
        self.pending_futures = Gauge(
            "miles_gateway_pending_futures", "Futures unresolved in this process", registry=self.registry
        )
        self.healthy = Gauge("miles_gateway_healthy", "1 when healthy", registry=self.registry)
        # the checkpoint filesystem, read on every sweep (miles/gateway/services/storage.py)
        fs_gauges = {
            "free": ("miles_checkpoint_fs_free_bytes", "Bytes this job may still write where checkpoints go"),
            "used": ("miles_checkpoint_fs_used_ratio", "Used fraction of the checkpoint filesystem"),
            "warning": ("miles_checkpoint_fs_warning", "1 while the checkpoint filesystem is nearly full"),
        }
        fs = {key: Gauge(name, text, registry=self.registry) for key, (name, text) in fs_gauges.items()}
        self.checkpoint_fs_free, self.checkpoint_fs_used, self.checkpoint_fs_warning = fs.values()
        self.queue_depth = Gauge(
            "miles_gateway_queue_depth",
            "Ordered operations waiting per model",
            ["model"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "miles_gateway_queue_wait_seconds",
            "Time an ordered operation waited before it ran",
            ["model"],
            registry=self.registry,
        )
        self.model_tenant = Gauge(
            "miles_gateway_model_tenant",
            "1 per (model, tenant) that submitted work",
            ["model", "tenant"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The gateway's metrics and the job's (training, pushes, engines, phases: docs/observability.md)."""
        return generate_latest(self.registry) + job_metrics().render()
