"""Session traces: where a session's time went, as a Chrome trace-event JSON file that ui.perfetto.dev opens
offline (the SDK's `export_session_trace`, `launcher trace RUN`).

`Operations` records, per operation of a session, its wait for its turn (`queue`: the per-model order, or a
sampling slot), the operation itself with its outcome, and, for forward_backward, its stages as the
`StageClock` measured them (prepare, dispatch to the trainer, the trainer's compute, encode), and each
trainer rank's compute on a track of that rank (`<model> rank <i>`), from the compute stage's start. Spans
live in memory, bounded per session and in the number of sessions: instrumentation, never state. A track is
one model or sampler; spans that overlap on a track (concurrent samples) get lanes of their own.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from miles.types import TimedPart

MAX_SPANS_PER_SESSION = 20_000
# at most about 64 x 20,000 spans of a few hundred bytes: a bounded few hundred MB on the busiest gateway
MAX_TRACED_SESSIONS = 64
# the StageClock stages an operation runs through after it starts, in order (the rest precede it)
RUN_STAGES = ("mark_running", "prepare", "dispatch", "compute", "encode")


@dataclass(frozen=True)
class Traced:
    """Where an operation's spans go: its session, its track (model or sampler) and when it was submitted."""

    session_id: str
    track: str
    submitted_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    category: str  # "queue", "operation" or "stage"
    track: str  # the model or sampler it belongs to
    start_s: float  # wall clock (time.time)
    duration_s: float
    args: Mapping[str, Any] = field(default_factory=dict)


class SpanSink(Protocol):
    def export(self, session_id: str, spans: Sequence[Span]) -> None: ...


class SessionTraces:
    """session id -> its newest spans; the sessions traced longest ago are dropped first. `sink` also gets
    every operation's spans as they are recorded (trace_otel.OtelExport when the preset names a collector)."""

    def __init__(self, per_session: int = MAX_SPANS_PER_SESSION, sessions: int = MAX_TRACED_SESSIONS) -> None:
        self._per_session = per_session
        self._sessions = sessions
        self._spans: OrderedDict[str, deque[Span]] = OrderedDict()
        self.sink: SpanSink | None = None

    def record(self, session_id: str, spans: Sequence[Span]) -> None:
        if self.sink is not None:
            self.sink.export(session_id, spans)
        kept = self._spans.get(session_id)
        if kept is None:
            kept = self._spans[session_id] = deque(maxlen=self._per_session)
            while len(self._spans) > self._sessions:
                self._spans.popitem(last=False)
        self._spans.move_to_end(session_id)
        kept.extend(spans)

    def spans(self, session_id: str) -> list[Span]:
        return list(self._spans.get(session_id, ()))


def operation_spans(
    *,
    kind: str,
    track: str,
    request_id: str,
    submitted_s: float,
    started_s: float,
    ended_s: float,
    outcome: str,
    stages_ns: Mapping[str, int] | None = None,
    ranks_ns: Sequence[int] = (),
    parts: Sequence[TimedPart] = (),
) -> list[Span]:
    """The spans of one operation: its wait, itself, the stages it ran through (laid end to end from its
    start, in the order RUN_STAGES names them), and each trainer rank's compute from the compute stage's
    start, on the rank's own track; and the work below the gateway (`parts`) on the lanes it names."""
    args = {"request_id": request_id, "outcome": outcome}
    spans = [
        Span("queue", "queue", track, submitted_s, max(started_s - submitted_s, 0.0), args),
        Span(kind, "operation", track, started_s, max(ended_s - started_s, 0.0), args),
    ]
    at = started_s
    for stage in RUN_STAGES:
        took = (stages_ns or {}).get(stage, 0) / 1e9
        if stage == "compute":
            for rank, rank_ns in enumerate(ranks_ns):
                rank_args = {"request_id": request_id, "rank": rank}
                spans.append(Span(kind, "rank", f"{track} rank {rank}", at, rank_ns / 1e9, rank_args))
        if took > 0:
            spans.append(Span(stage, "stage", track, at, took, {"request_id": request_id}))
            at += took
    for part in parts:  # a push's buckets, an engine's generation: on a lane of the track of their own
        part_args = {"request_id": request_id, **part.args}
        spans.append(
            Span(part.name, part.lane, f"{track} {part.lane}", part.start_s, part.duration_s, part_args)
        )
    return spans


def assign_lanes(spans: Sequence[Span]) -> list[int]:
    """Per span, a lane of its track such that spans in one lane never overlap, except a stage, which goes
    in its operation's lane, nested in it (Chrome trace "X" events on one thread must nest)."""
    lanes: list[int] = [0] * len(spans)
    ends: dict[str, list[float]] = {}  # track -> the end of the last span in each lane
    operation_lane: dict[Any, int] = {}  # request id -> the lane of its operation span
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_s, spans[i].category == "stage"))
    for i in order:
        span = spans[i]
        request_id = span.args.get("request_id")
        if span.category == "stage" and request_id in operation_lane:
            lanes[i] = operation_lane[request_id]
            continue
        track_ends = ends.setdefault(span.track, [])
        lane = next((n for n, end in enumerate(track_ends) if end <= span.start_s), len(track_ends))
        if lane == len(track_ends):
            track_ends.append(0.0)
        track_ends[lane] = span.start_s + span.duration_s
        lanes[i] = lane
        if span.category == "operation":
            operation_lane[request_id] = lane
    return lanes


def chrome_trace(
    processes: Mapping[str, Sequence[Span]], *, exported_at: float | None = None
) -> dict[str, Any]:
    """A Chrome trace-event document: one process per key (a session), one thread per track and lane."""
    events: list[dict[str, Any]] = []
    for pid, (process, spans) in enumerate(processes.items(), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        threads: dict[tuple[str, int], int] = {}
        for span, lane in zip(spans, assign_lanes(spans), strict=True):
            key = (span.track, lane)
            if key not in threads:
                threads[key] = tid = len(threads) + 1
                label = span.track if lane == 0 else f"{span.track} ({lane + 1})"
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}}
                )
            events.append(
                {
                    "ph": "X",
                    "name": span.name,
                    "cat": span.category,
                    "pid": pid,
                    "tid": threads[key],
                    "ts": round(span.start_s * 1e6, 3),
                    "dur": round(span.duration_s * 1e6, 3),
                    "args": dict(span.args),
                }
            )
    exported = time.time() if exported_at is None else exported_at
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": {"exported_at": exported}}
