"""Prometheus metrics on the gateway's own registry (so several apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
