"""Session trace spans to an OpenTelemetry collector (OTLP over HTTP), when the preset names one
(`gateway.otel_endpoint`): the same spans `export_session_trace` shows, as they are recorded.

Each operation is a span with its wait (`queue`) and its stages as children; the attributes name the session,
the track (model or sampler), the request and the outcome. The SDK's batch processor sends from its own
thread, so recording never waits on the collector, and a collector that is down loses spans, not requests.
OpenTelemetry is imported here only: a gateway without an endpoint never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles.gateway.traces import Span

SERVICE_NAME = "miles-gateway"


# every other span category (stage, rank, push, engine) is sent as a child of its operation
OWN_SPANS = ("queue", "operation")


class OtelExport:
    def __init__(self, endpoint: str, *, exporter: Any = None) -> None:
        """`exporter`: an OpenTelemetry SpanExporter to use instead of OTLP/HTTP to `endpoint` (tests)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("miles.gateway.traces")

    def export(self, session_id: str, spans: Sequence[Span]) -> None:
        """One operation's spans (operation_spans' order: queue, the operation, its stages)."""
        from opentelemetry import trace

        parent = None
        for span in spans:
            child = span.category not in OWN_SPANS
            context = trace.set_span_in_context(parent) if parent is not None and child else None
            attributes = {
                "miles.session_id": session_id,
                "miles.track": span.track,
                "miles.category": span.category,
                **{f"miles.{key}": str(value) for key, value in span.args.items()},
            }
            start_ns = int(span.start_s * 1e9)
            otel_span = self._tracer.start_span(
                span.name, context=context, start_time=start_ns, attributes=attributes
            )
            otel_span.end(end_time=start_ns + int(span.duration_s * 1e9))
            if span.category == "operation":
                parent = otel_span

    def close(self) -> None:
        """Send what is buffered, then stop the sending thread."""
        self._provider.shutdown()
