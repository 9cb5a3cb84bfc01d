"""Session traces: the lanes and document (pure), the SDK's export_session_trace through a served gateway
(owner only, the link is the credential, the operations and their stages in the file), and `launcher trace`
merging a job's sessions."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
from click.testing import CliRunner
from runtime_double import BASE, DoubleRuntime
from tinker import types

from launcher.cli import main
from launcher.run_state import GATEWAY_URL_FILE, GENERATED_KEY_FILE
from launcher.runs import create_run
from launcher.trace import merge_traces
from miles.errors import UserError
from miles.gateway.metrics import GatewayMetrics
from miles.gateway.operations import Operations
from miles.gateway.settings import GatewaySettings
from miles.gateway.stages import StageClock
from miles.gateway.traces import SessionTraces, Span, Traced, assign_lanes, chrome_trace, operation_spans
from miles.seam.requests import ForwardBackwardRequest
from miles.state import MemoryStateStore
from miles.state.claims import DedupClaims
from miles.state.futures import FutureRepository
from miles.train.coalescer import ForwardBackwardMany
from miles.train.commands import ForwardBackward
from miles.types import ForwardBackwardOutput, TimedPart
from miles.weights.push import BucketTiming, PushReport, push_timeline
from tests.fast.local_gateway import local_gateway

OWNER, STRANGER = "tml-trace-owner-0001", "tml-trace-stranger-01"


def _op(request_id: str, submitted: float, started: float, ended: float, stages=None) -> list[Span]:
    return operation_spans(
        kind="ForwardBackward",
        track="m",
        request_id=request_id,
        submitted_s=submitted,
        started_s=started,
        ended_s=ended,
        outcome="complete",
        stages_ns=stages,
    )


def test_stages_nest_in_their_operation_and_overlapping_spans_get_lanes() -> None:
    # the SDK pipelines: the second request waits in the queue while the first runs
    first = _op("r1", 0.0, 0.1, 1.0, {"prepare": 100_000_000, "compute": 600_000_000, "queue_wait": 5})
    second = _op("r2", 0.2, 1.0, 2.0, {"compute": 900_000_000})
    spans = first + second
    lanes = assign_lanes(spans)
    by_name = {(s.name, s.args["request_id"]): lane for s, lane in zip(spans, lanes, strict=True)}
    assert [s.name for s in first] == ["queue", "ForwardBackward", "prepare", "compute"]  # run stages only
    assert first[3].start_s == pytest.approx(0.2) and first[3].duration_s == pytest.approx(0.6)
    assert by_name["prepare", "r1"] == by_name["compute", "r1"] == by_name["ForwardBackward", "r1"]
    assert by_name["queue", "r2"] != by_name["ForwardBackward", "r1"]  # overlaps it: a lane of its own
    assert by_name["compute", "r2"] == by_name["ForwardBackward", "r2"]
    document = chrome_trace({"session s": spans}, exported_at=0.0)
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(spans) and all(e["dur"] >= 0 and "ts" in e for e in events)
    threads = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["m", "m (2)"]


def test_ranks_pushes_and_engines_get_tracks_of_their_own() -> None:
    push = PushReport(version=3, buckets=2, bytes=96, engines=1, steps={"prepare": 0.05, "release": 0.02})
    push.bucket_timings = [
        BucketTiming(bytes=64, start_s=0.05, pack_wait_s=0.0, wire_s=0.01, trainer_done_s=0.07, end_s=0.09),
        BucketTiming(bytes=32, start_s=0.09, pack_wait_s=0.0, wire_s=0.01, trainer_done_s=0.1, end_s=0.12),
    ]
    parts = [
        *push_timeline(push, 10.0),
        TimedPart("generate", "engine", 10.5, 0.25, {"completion_tokens": 8}),
    ]
    spans = operation_spans(
        kind="ForwardBackward",
        track="m",
        request_id="r1",
        submitted_s=9.9,
        started_s=10.0,
        ended_s=11.0,
        outcome="complete",
        stages_ns={"prepare": 100_000_000, "compute": 700_000_000},
        ranks_ns=(700_000_000, 450_000_000),
        parts=parts,
    )
    ranks = [s for s in spans if s.category == "rank"]
    assert [(s.track, s.start_s, s.duration_s) for s in ranks] == [
        ("m rank 0", pytest.approx(10.1), pytest.approx(0.7)),
        ("m rank 1", pytest.approx(10.1), pytest.approx(0.45)),
    ]  # from the compute stage's start, each rank's own time
    buckets = [s for s in spans if s.name == "bucket"]
    assert [(s.start_s, s.duration_s, s.args["bytes"]) for s in buckets] == [
        (pytest.approx(10.05), pytest.approx(0.04), 64),
        (pytest.approx(10.09), pytest.approx(0.03), 32),
    ]
    assert [s.name for s in spans if s.track == "m push"] == ["prepare", "bucket", "bucket", "release"]
    document = chrome_trace({"session s": spans}, exported_at=0.0)
    threads = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"m", "m rank 0", "m rank 1", "m push", "m engine"}


def test_every_rank_reports_its_compute_time() -> None:
    outputs = [ForwardBackwardOutput([], [], compute_ns=ns) for ns in (5, 9, 7)]
    command = ForwardBackward.of(ForwardBackwardRequest("m", [], "cross_entropy", {}))
    combined = command.combine(outputs)
    assert combined is outputs[0] and combined.rank_compute_ns == (5, 9, 7)
    many = ForwardBackwardMany((command, command))
    failed = UserError("bad datum")
    per_rank = [[ForwardBackwardOutput([], [], compute_ns=ns), failed] for ns in (3, 4)]
    first, second = many.combine(per_rank)
    assert first.rank_compute_ns == (3, 4) and second is failed


def test_traces_are_bounded_per_session_and_in_sessions() -> None:
    traces = SessionTraces(per_session=3, sessions=2)
    for n in range(5):
        traces.record("a", _op(f"r{n}", 0, 0, 1)[:1])
    assert [s.args["request_id"] for s in traces.spans("a")] == ["r2", "r3", "r4"]
    traces.record("b", _op("x", 0, 0, 1))
    traces.record("c", _op("y", 0, 0, 1))
    assert traces.spans("a") == [] and traces.spans("b") and traces.spans("c")


@pytest.fixture
def served(tmp_path: Path):
    with local_gateway(DoubleRuntime(), tmp_path / "ckpt", {OWNER: "owner", STRANGER: "stranger"}) as url:
        yield url


def _train(service: tinker.ServiceClient, steps: int) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    for _ in range(steps):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def test_export_session_trace_gives_the_owner_a_link_to_the_sessions_operations(served: str) -> None:
    service = tinker.ServiceClient(base_url=served, api_key=OWNER)
    _train(service, steps=2)
    session_id = service.holder.get_session_id()
    url = service.create_rest_client().export_session_trace(session_id).result()
    with urllib.request.urlopen(url) as answer:  # no API key: the signed link is the credential
        document = json.load(answer)
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    operations = [e["name"] for e in spans if e["cat"] == "operation"]
    assert operations == ["CreateModel", "ForwardBackward", "OptimStep", "ForwardBackward", "OptimStep"]
    assert {e["args"]["outcome"] for e in spans if e["cat"] == "operation"} == {"complete"}
    assert {"prepare", "dispatch", "encode"} <= {e["name"] for e in spans if e["cat"] == "stage"}
    assert sum(e["cat"] == "queue" for e in spans) == 5

    stranger = tinker.ServiceClient(base_url=served, api_key=STRANGER).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        stranger.export_session_trace(session_id).result()
    forged = url.replace("signature=", "signature=0")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(forged)
    assert refused.value.code == 404


def test_launcher_trace_merges_every_session_of_the_jobs_key(
    served: str, tmp_path: Path, monkeypatch
) -> None:
    for _ in range(2):
        _train(tinker.ServiceClient(base_url=served, api_key=OWNER), steps=1)
    _train(tinker.ServiceClient(base_url=served, api_key=STRANGER), steps=1)  # another tenant: not ours
    monkeypatch.setenv("MILES_RUNS_DIR", str(tmp_path / "runs"))
    run = create_run("hand-made", "local", base=tmp_path / "runs")
    (run.path / GATEWAY_URL_FILE).write_text(served)
    (run.path / GENERATED_KEY_FILE).write_text(OWNER)
    result = CliRunner().invoke(main, ["trace", run.run_id, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    document = json.loads(Path(summary["path"]).read_text())
    assert summary["sessions"] == 2 and summary["spans"] == sum(
        e["ph"] == "X" for e in document["traceEvents"]
    )
    processes = [e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"]
    assert len(processes) == len(set(processes)) == 2
    assert len({e["pid"] for e in document["traceEvents"]}) == 2  # a process per session, renumbered

    (run.path / GENERATED_KEY_FILE).write_text("tml-not-a-key-000000")
    refused = CliRunner().invoke(main, ["trace", run.run_id], catch_exceptions=False)
    assert refused.exit_code != 0 and "401" in refused.output


def test_merging_keeps_each_documents_processes_apart() -> None:
    one = chrome_trace({"a": _op("r1", 0, 0, 1)}, exported_at=0.0)
    two = chrome_trace({"b": _op("r2", 0, 0, 1), "c": _op("r3", 0, 0, 1)}, exported_at=0.0)
    merged = merge_traces([one, two])
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "a", 2: "b", 3: "c"}


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps every POSTed ExportTraceServiceRequest body."""

    bodies: list[bytes] = []

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_spans_go_to_the_collector_the_preset_names_with_stages_under_their_operation(tmp_path: Path) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    _Collector.bodies = []
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    try:
        settings = GatewaySettings(otel_endpoint=endpoint)
        with local_gateway(DoubleRuntime(), tmp_path / "ckpt", {OWNER: "owner"}, settings=settings) as url:
            service = tinker.ServiceClient(base_url=url, api_key=OWNER)
            _train(service, steps=1)
            session_id = service.holder.get_session_id()
        # the gateway's shutdown sent what was buffered
    finally:
        collector.shutdown()
    spans = []
    for body in _Collector.bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service_name = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            assert service_name["service.name"] == "miles-gateway"
            spans += [span for scope in resource_spans.scope_spans for span in scope.spans]
    attributes = [{a.key: a.value.string_value for a in span.attributes} for span in spans]
    assert {a["miles.session_id"] for a in attributes} == {session_id}
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert len(by_name["ForwardBackward"]) == len(by_name["OptimStep"]) == 1
    assert len(by_name["queue"]) == 3  # CreateModel, ForwardBackward, OptimStep
    operation = by_name["ForwardBackward"][0]
    for stage in ("prepare", "dispatch", "encode"):
        child = by_name[stage][0]
        assert child.parent_span_id == operation.span_id and child.trace_id == operation.trace_id
        assert operation.start_time_unix_nano <= child.start_time_unix_nano <= operation.end_time_unix_nano
    assert not by_name["queue"][0].parent_span_id  # the wait is not part of the operation


async def test_a_samples_wait_for_its_slot_is_its_queue_not_a_stage_of_it() -> None:
    """A concurrent operation's clock starts at submit; the time it waits for a sampling slot is its queue
    span, and its stages (laid from when it started) stay inside the operation."""
    store = MemoryStateStore()
    futures = FutureRepository(store, ttl_s=60)
    ops = Operations(futures, DedupClaims(store), GatewaySettings(), GatewayMetrics())
    slot = asyncio.Semaphore(1)
    await slot.acquire()  # the only slot is taken: the sample waits

    async def sample() -> dict:
        return {}

    request_id, _ = await ops.submit_concurrent(
        tenant="t",
        kind="Sample",
        model_id=None,
        dedup=None,
        idempotency_key=None,
        operation=sample,
        slots=slot,
        traced=Traced("s", "s:sample:0"),
        clock=StageClock(),
    )
    await asyncio.sleep(0.3)
    slot.release()
    await futures.wait("t", request_id, 5)
    spans = {span.name: span for span in ops.traces.spans("s")}
    assert spans["queue"].duration_s >= 0.25
    operation = spans["Sample"]
    for stage in (s for s in spans.values() if s.category == "stage"):
        assert stage.start_s + stage.duration_s <= operation.start_s + operation.duration_s + 1e-3, stage
    await ops.close()
