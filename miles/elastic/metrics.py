"""The elastic controller's metrics, in the job's registry (miles/observability/metrics.py renders it).

`miles_elastic_decisions_total{action, reason}`: every decision, holds included (reason = the decision's
stable code); `miles_elastic_gpu_owner{owner}`: GPUs per owner kind (engine, lane, free) from the ledger;
`miles_elastic_shortfalls_total`: engines that could not be freed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from miles.elastic.ledger import GpuLedger
from miles.elastic.policy import Decision

OWNER_KINDS = ("engine", "lane", "free")


class ElasticMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "miles_elastic_decisions", "Elastic controller decisions", ["action", "reason"], registry=registry
        )
        self.gpu_owner = Gauge("miles_elastic_gpu_owner", "GPUs per owner kind", ["owner"], registry=registry)
        self.shortfalls = Counter(
            "miles_elastic_shortfalls", "Engines that could not be freed for a borrow", registry=registry
        )
        self._shortfalls_seen = 0

    def count(self, decision: Decision) -> None:
        """Pass as ElasticController(on_decision=...)."""
        self.decisions.labels(decision.action, decision.code).inc()

    def observe_ledger(self, ledger: GpuLedger) -> None:
        owners = [owner.split(":", 1)[0] for owner in ledger.owners().values()]
        for kind in OWNER_KINDS:
            self.gpu_owner.labels(kind).set(owners.count(kind))
        new = len(ledger.shortfalls) - self._shortfalls_seen
        if new > 0:
            self.shortfalls.inc(new)
            self._shortfalls_seen = len(ledger.shortfalls)
