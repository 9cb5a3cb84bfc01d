"""The job's Prometheus metrics: one registry per process, rendered by the gateway's /metrics next to its
own (the gateway runs inside the driver, where every value below is measured).

Why no exporter per Ray actor: everything the trainer and the engines do passes through the driver
(trainer commands return their results to it, sampling and weight pushes are driver-side HTTP calls), so
the driver measures durations, tokens and loss from the results it already holds. Names and labels:
docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Durations from milliseconds (tiny CPU runs) to many minutes (a 27B push over a slow fabric).
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
GAP_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)
ENGINE_STATES = ("new", "starting", "pending_weights", "ready", "failed", "stopped", "lent", "released")


class JobMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._training()
        self._weights()
        self._engines()
        self._job()

    def _histogram(self, name: str, doc: str, labels: Iterable[str], buckets=SECONDS_BUCKETS) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def _training(self) -> None:
        self.train_seconds = self._histogram(
            "miles_train_command_seconds", "Trainer command duration", ["model", "command"]
        )
        self.train_tokens = self._counter(
            "miles_train_tokens", "Tokens through forward_backward (rate() = tokens/s)", ["model"]
        )
        self.train_tokens_per_second = self._gauge(
            "miles_train_tokens_per_second", "Tokens/s of the model's last forward_backward", ["model"]
        )
        self.train_loss = self._gauge(
            "miles_train_loss", "Mean loss per weighted token of the last forward_backward", ["model"]
        )
        self.optim_steps = self._counter("miles_train_optim_steps", "Optimizer steps taken", ["model"])
        self.train_refusals = self._counter(
            "miles_train_refusals",
            "Commands refused for the caller's input (preflight: bad batch, unknown model)",
            ["model", "command"],
        )

    def _weights(self) -> None:
        self.push_seconds = self._histogram("miles_push_seconds", "Weight push duration", ["kind"])
        self.push_bytes = self._counter("miles_push_bytes", "Bytes pushed to the engines", ["kind"])
        self.push_buckets = self._counter("miles_push_buckets", "Buckets pushed", ["kind"])
        self.push_max_gap = self._gauge(
            "miles_push_max_bucket_gap_seconds", "Largest gap between two buckets in the last push"
        )
        self.push_gap = self._histogram(
            "miles_push_bucket_gap_seconds", "Gap between two consecutive buckets", [], buckets=GAP_BUCKETS
        )
        self.push_aborts = self._counter("miles_push_aborts", "Pushes aborted", ["kind", "reason"])
        # the delta push (docs/weights.md "Delta push"): what went out against what a full push sends
        self.push_dense_bytes = self._counter(
            "miles_push_dense_bytes", "Bytes a full push would have sent, for pushes by mode", ["mode"]
        )
        self.push_delta_density = self._gauge(
            "miles_push_delta_density", "Changed fraction of the 16-bit words of the last delta push"
        )
        self.push_delta_buckets = self._counter(
            "miles_push_delta_buckets", "Buckets of delta pushes, by the form sent", ["form"]
        )
        self.push_delta_fallbacks = self._counter(
            "miles_push_delta_fallbacks", "Full pushes while delta pushes are on, by why", ["reason"]
        )
        self.push_digest_mismatches = self._counter(
            "miles_push_digest_mismatches", "Delta pushes whose engines' digests differed from the trainer's"
        )
        self.engines_ready = self._counter(
            "miles_push_engines_marked_ready", "Engines marked weights-ready by a push"
        )

    def _engines(self) -> None:
        self.engine_state = self._gauge(
            "miles_engine_state", "1 for the engine cell's current state", ["engine", "state"]
        )
        self.engine_respawns = self._counter("miles_engine_respawns", "Engine respawns", ["engine"])
        self.sample_in_flight = self._gauge("miles_engine_requests_in_flight", "Sampling requests running")
        self.generated_tokens = self._counter(
            "miles_engine_generated_tokens", "Tokens generated (rate() = tokens/s)"
        )
        self.adapters_loaded = self._gauge(
            "miles_engine_adapters_loaded", "LoRA adapters the engines serve (published)"
        )

    def _job(self) -> None:
        self.phase_seconds = self._gauge(
            "miles_job_phase_seconds", "Duration of a finished bring-up phase", ["phase"]
        )
        self.phase = self._gauge("miles_job_phase", "1 for the phase the driver is in", ["phase"])
        self.trainer_alive = self._gauge(
            "miles_job_trainer_cell_alive", "1 while the cell is alive", ["cell"]
        )
        self.nodes_alive = self._gauge("miles_job_ray_nodes_alive", "Ray nodes alive")
        self.nodes_expected = self._gauge("miles_job_ray_nodes_expected", "Nodes the job was given")

    def set_engine_state(self, engine: str, state: str) -> None:
        for name in ENGINE_STATES:
            self.engine_state.labels(engine, name).set(1 if name == state else 0)

    def enter_phase(self, name: str, previous: str | None, previous_seconds: float) -> None:
        if previous is not None:
            self.phase.labels(previous).set(0)
            self.phase_seconds.labels(previous).set(previous_seconds)
        self.phase.labels(name).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_metrics: JobMetrics | None = None


def job_metrics() -> JobMetrics:
    """This process's job metrics (created on first use)."""
    global _metrics
    if _metrics is None:
        _metrics = JobMetrics()
    return _metrics
