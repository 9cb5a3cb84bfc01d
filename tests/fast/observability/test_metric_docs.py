"""Every metric the job exports is documented (docs/observability.md), under the name a scrape shows."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from miles.gateway.metrics import GatewayMetrics
from miles.observability.metrics import JobMetrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "observability.md"


def exported_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        # a counter's family is scraped with _total; histograms by their base name
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_every_job_and_queue_metric_is_in_the_docs_table() -> None:
    documented = set(re.findall(r"^\| `(miles_[a-z_]+)` \|", DOC.read_text(), flags=re.M))
    job = exported_names(JobMetrics().registry)
    queue = {n for n in exported_names(GatewayMetrics().registry) if "queue" in n or "tenant" in n}
    assert len(job) > 20
    assert job | queue <= documented, sorted((job | queue) - documented)
    assert documented - job - exported_names(GatewayMetrics().registry) == set()  # nothing stale
