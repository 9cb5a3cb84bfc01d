"""The floors under bench/gateway.py's overhead: what a Ray actor call and the SDK's HTTP exchanges cost
on this machine when nothing of ours runs.

    .venv/bin/python bench/gateway_floors.py ray [--calls 150] [--compute-ms 20] [--rounds 2]
    .venv/bin/python bench/gateway_floors.py http [--calls 150] [--rounds 2]
    .venv/bin/python bench/gateway_floors.py handoff [--calls 150] [--rounds 2]

`ray`: one actor call awaited from an asyncio loop (as the gateway awaits its trainer), less the time the
actor spent inside the method: a no-op, the trainer's real `ForwardBackward` command (4 x 64 tokens) answered
with a `ForwardBackwardOutput` at once, and the same answered after `--compute-ms` of a busy loop (the
GIL held, as a forward_backward holds it for most of its time) or of sleep; with the actor plain or with the
trainer's concurrency groups (a threaded actor), with `ray.get` in a thread, and through a Ray compiled graph
(`experimental_compile`, shared-memory channels, awaited with `execute_async`) on a threaded actor.

`http`: a no-op Tinker server (raw ASGI: every route answers fixed bytes at once, forward_backward with a
real ForwardBackwardOutput protobuf) served by uvicorn in a process of its own, once per (HTTP parser, event
loop); per forward_backward the real SDK's wall time, and a plain httpx client posting the same bytes
(submit + one retrieve_future). The SDK's number is what the SDK and HTTP cost with no server work at all.

`handoff`: the local runtime's hand-off of a command to the compute thread and back, in one process on the
gateway's event loop (uvloop): the real ForwardBackward command (tiny model, 4 x 64 tokens, LoRA) through
`asyncio.to_thread` (the old path) and through `InProcessTrainer` (a dedicated thread, completed with
`call_soon_threadsafe`), each with `sys.setswitchinterval` at 5 ms (Python's default), 0.5 ms and 20 ms
during the compute; with the loop idle, and with the loop busy 0.2 ms of every 2 ms (as while it answers
HTTP). Prints the hand-off (wall less the command's compute_ns) and the compute itself, next to the same
command called on the loop's thread (no hand-off, no sharing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from miles.train.commands import ForwardBackward
from miles.types import Datum, ForwardBackwardOutput
from miles.utils.serving import free_port

SERVERS = (("h11", "asyncio"), ("httptools", "asyncio"), ("h11", "uvloop"), ("httptools", "uvloop"))
# what the gateway's /client/config answers (miles/gateway/tinker/routes_core.py); `sdk` varies these
SERVED_CONFIG: dict[str, Any] = {"proto_compress_fwdbwd": True}
SDK_CONFIGS: tuple[dict[str, Any], ...] = (
    {"proto_compress_fwdbwd": True, "use_pyqwest_transport": True},
    {"proto_compress_fwdbwd": False, "use_pyqwest_transport": True},
    {"proto_compress_fwdbwd": True, "use_pyqwest_transport": False},
    {"proto_compress_fwdbwd": False, "use_pyqwest_transport": False},
)


def _quartiles(values: list[float]) -> str:
    q1, q2, q3 = np.percentile(np.asarray(values), [25, 50, 75])
    return f"p50 {q2:6.2f} ms (IQR {q1:.2f} .. {q3:.2f})"


def forward_backward_command(batch: int = 4, tokens: int = 64) -> ForwardBackward:
    rng = np.random.default_rng(0)
    data = [
        Datum(
            model_input=rng.integers(10, 1000, tokens),
            loss_fn_inputs={
                "target_tokens": rng.integers(10, 1000, tokens),
                "weights": np.ones(tokens, np.float32),
            },
        )
        for _ in range(batch)
    ]
    return ForwardBackward("bench", data, "cross_entropy", {})


def _output(batch: int = 4, tokens: int = 64) -> ForwardBackwardOutput:
    row = np.full(tokens, -6.9, np.float32)
    return ForwardBackwardOutput(
        logprobs=[row] * batch, elementwise_loss=[-row] * batch, metrics={"loss:sum": 1.0}
    )


class FloorActor:
    """Answers at once, or after `compute_s` of a busy loop (< 0: that long asleep instead)."""

    def noop(self) -> int:
        return 0

    def execute(self, command: ForwardBackward, compute_s: float) -> ForwardBackwardOutput:
        started = time.perf_counter_ns()
        if compute_s < 0:
            time.sleep(-compute_s)
        else:
            end = time.perf_counter() + compute_s
            while time.perf_counter() < end:
                pass
        out = _output(len(command.data))
        out.compute_ns = time.perf_counter_ns() - started
        return out


async def _time_calls(call: Callable[[], Awaitable[Any]], calls: int) -> list[float]:
    for _ in range(10):
        await call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        out = await call()
        elapsed = (time.perf_counter() - start) * 1000
        times.append(elapsed - (out.compute_ns / 1e6 if isinstance(out, ForwardBackwardOutput) else 0.0))
    return times


async def _compiled_graph(actor: Any) -> tuple[Any, Callable[[Any, float], Awaitable[Any]]]:
    """A compiled graph of one `execute` node on `actor` (shared-memory channels); returns the graph and
    an awaitable call through it, as the gateway's loop would make it."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as graph_input:
        dag = MultiOutputNode([actor.execute.bind(graph_input[0], graph_input[1])])
    compiled = dag.experimental_compile(enable_asyncio=True)

    async def call(command: Any, compute_s: float) -> Any:
        futures = await compiled.execute_async(command, compute_s)  # one per output node
        return await futures[0]

    return compiled, call


async def _ray_floors(calls: int, compute_s: float, rounds: int) -> None:
    import ray

    plain = ray.remote(num_cpus=0)(FloorActor).remote()
    threaded = ray.remote(num_cpus=0, concurrency_groups={"health": 1})(FloorActor).remote()
    graphed = ray.remote(num_cpus=0, concurrency_groups={"health": 1})(FloorActor).remote()
    await graphed.noop.remote()
    compiled, graph_call = await _compiled_graph(graphed)
    command = forward_backward_command()
    loop = asyncio.get_running_loop()
    cases: dict[str, Callable[[], Awaitable[Any]]] = {
        "plain actor, no-op": lambda: plain.noop.remote(),
        "plain, ForwardBackward, answered at once": lambda: plain.execute.remote(command, 0.0),
        "threaded (concurrency groups), at once": lambda: threaded.execute.remote(command, 0.0),
        f"plain, after {compute_s * 1000:.0f} ms busy (GIL held)": lambda: plain.execute.remote(
            command, compute_s
        ),
        f"threaded, after {compute_s * 1000:.0f} ms busy": lambda: threaded.execute.remote(
            command, compute_s
        ),
        f"plain, after {compute_s * 1000:.0f} ms asleep": lambda: plain.execute.remote(command, -compute_s),
        f"plain, {compute_s * 1000:.0f} ms busy, ray.get in a thread": lambda: loop.run_in_executor(
            None, ray.get, plain.execute.remote(command, compute_s)
        ),
        "compiled graph (shm channels), at once": lambda: graph_call(command, 0.0),
        f"compiled graph, after {compute_s * 1000:.0f} ms busy": lambda: graph_call(command, compute_s),
    }
    await _time_calls(cases["plain actor, no-op"], 50)  # the workers are up and warm
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # the cases take turns, so a busy moment of the machine hits them all
        for name, call in cases.items():
            times[name] += await _time_calls(call, calls // rounds)
    compiled.teardown()
    for name in cases:
        print(f"  {name:<48} {_quartiles(times[name])}", flush=True)


def run_ray(calls: int, compute_ms: float, rounds: int) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(
        f"Ray actor call from an asyncio loop, less the time inside the method: {calls} calls each, in "
        f"{rounds} turns"
    )
    try:
        asyncio.run(_ray_floors(calls, compute_ms / 1000, rounds))
    finally:
        ray.shutdown()


# ---- http ---------------------------------------------------------------------------------------------


def _noop_app(client_config: dict[str, Any]) -> Callable[..., Awaitable[None]]:
    from miles.gateway.tinker.codec import encode_forward_backward_output

    result = encode_forward_backward_output(_output())
    fixed = {
        "/api/v1/create_session": {"type": "create_session", "session_id": "s1"},
        "/api/v1/client/config": {"pjwt_auth_enabled": False, **client_config},
        "/api/v1/get_info": {
            "type": "get_info",
            "model_id": "m1",
            "model_data": {"model_name": "bench", "tokenizer_id": "bench"},
            "is_lora": True,
            "lora_rank": 8,
            "model_name": "bench",
        },
    }
    futures: dict[str, str] = {}

    async def body(receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    def answer(path: str, request: bytes) -> tuple[bytes, bytes]:
        if path in ("/api/v1/forward_backward", "/api/v1/create_model"):
            request_id = f"r{len(futures)}"
            futures[request_id] = path
            return b"application/json", json.dumps({"request_id": request_id, "model_id": "m1"}).encode()
        if path == "/api/v1/retrieve_future":
            if futures.get(json.loads(request)["request_id"]) == "/api/v1/forward_backward":
                return b"application/x-protobuf", result
            return b"application/json", b'{"type": "create_model", "model_id": "m1"}'
        return b"application/json", json.dumps(fixed.get(path, {})).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        content_type, payload = answer(scope["path"], await body(receive))
        headers = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def serve_noop(port: int, http: str, loop: str, client_config: dict[str, Any]) -> None:
    import uvicorn

    app = _noop_app(client_config)
    uvicorn.run(app, host="127.0.0.1", port=port, http=http, loop=loop, log_level="warning")


def _sdk_data() -> list[Any]:
    from tinker import types

    rng = np.random.default_rng(0)
    rows = [rng.integers(10, 1000, size=65).tolist() for _ in range(4)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * 64},
        )
        for r in rows
    ]


def _sdk_times(url: str, calls: int) -> tuple[list[float], list[float]]:
    """Per forward_backward: wall ms, and CPU ms of this whole process (every SDK thread; robust to a
    loaded machine, where the wall time mostly measures waiting for a core)."""
    import tinker

    tc = tinker.ServiceClient(base_url=url, api_key="tml-bench").create_lora_training_client(
        base_model="bench", rank=8
    )
    tc = tc.result()
    data = _sdk_data()
    times, cpu = [], []
    for i in range(calls + 10):
        start, start_cpu = time.perf_counter(), time.process_time()
        tc.forward_backward(data, "cross_entropy").result()
        if i >= 10:
            times.append((time.perf_counter() - start) * 1000)
            cpu.append((time.process_time() - start_cpu) * 1000)
    return times, cpu


def _raw_times(url: str, calls: int) -> list[float]:
    import httpx
    import zstandard
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=_sdk_data(), loss_fn="cross_entropy"),
        model_id="m1",
        seq_id=1,
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(request).SerializeToString())
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    times = []
    with httpx.Client(base_url=url) as client:
        for i in range(calls + 10):
            start = time.perf_counter()
            request_id = client.post("/api/v1/forward_backward", content=body, headers=headers).json()[
                "request_id"
            ]
            client.post("/api/v1/retrieve_future", json={"request_id": request_id})
            if i >= 10:
                times.append((time.perf_counter() - start) * 1000)
    return times


def _measure_server(
    http: str, loop: str, calls: int, client_config: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    """The SDK's wall and CPU ms ("sdk", "sdk_cpu") and httpx's wall ms ("raw") per forward_backward."""
    import httpx

    port = free_port()
    config = json.dumps(client_config if client_config is not None else SERVED_CONFIG)
    server = subprocess.Popen([sys.executable, __file__, "serve-noop", str(port), http, loop, config])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        # the client in a process of its own too: an SDK session left behind keeps heartbeating on the
        # SDK's one loop thread
        client = [sys.executable, __file__, "measure-client", url, str(calls)]
        return json.loads(subprocess.run(client, check=True, capture_output=True, text=True).stdout)
    finally:
        server.terminate()
        server.wait()


def run_http(calls: int, rounds: int) -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(f"forward_backward against a no-op server (uvicorn parser + loop), {calls} calls, {rounds} rounds")
    for _ in range(rounds):
        for http, loop in SERVERS:
            times = _measure_server(http, loop, calls)
            sdk, raw = times["sdk"], times["raw"]
            print(f"  {http:>9} + {loop:<7}  SDK {_quartiles(sdk)}   httpx {_quartiles(raw)}", flush=True)


# ---- handoff ------------------------------------------------------------------------------------------

SWITCH_INTERVALS_S = (0.005, 0.0005, 0.02)


def _tiny_backend() -> Any:
    import tempfile
    from pathlib import Path

    import torch

    from miles.models.tiny import build_tiny_model
    from miles.train.backends.transformers_backend import TransformersBackend
    from miles.types import LoraSpec

    torch.set_num_threads(1)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-floors-")) / "model")
    backend = TransformersBackend(str(model_dir), train_mode="lora")
    backend.create_adapter("bench", LoraSpec(rank=8, seed=0))
    return backend


async def _loop_busy(stop: asyncio.Event) -> None:
    """The loop's own work while a command computes: 0.2 ms of Python every 2 ms."""
    while not stop.is_set():
        end = time.perf_counter() + 0.0002
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0.002)


async def _handoff_round(
    backend: Any, calls: int, busy: bool, times: dict[str, list[tuple[float, float]]]
) -> None:
    from miles.train.in_process import InProcessTrainer

    trainer = InProcessTrainer(backend)
    command = forward_backward_command()  # on the adapter _tiny_backend made, "bench"
    paths: dict[str, Callable[[], Awaitable[ForwardBackwardOutput]]] = {
        "asyncio.to_thread": lambda: asyncio.to_thread(command.run, backend),
        "InProcessTrainer (its own thread)": lambda: trainer.run(command),
    }
    stop = asyncio.Event()
    busy_task = asyncio.create_task(_loop_busy(stop)) if busy else None
    for call in paths.values():
        for _ in range(5):
            await call()
    cases = [(name, call, interval) for name, call in paths.items() for interval in SWITCH_INTERVALS_S]
    for step in range(calls):
        for k in range(len(cases)):  # rotated, so no case always runs right after the baseline
            name, call, interval = cases[(step + k) % len(cases)]
            sys.setswitchinterval(interval)
            start = time.perf_counter_ns()
            out = await call()
            wall = time.perf_counter_ns() - start
            sys.setswitchinterval(0.005)
            times.setdefault(f"{name}, switch {interval * 1000:g} ms", []).append(
                ((wall - out.compute_ns) / 1e6, out.compute_ns / 1e6)
            )
        out = command.run(backend)  # on the loop's thread: no hand-off, nothing shares the GIL
        times.setdefault("on the loop's thread (baseline)", []).append((0.0, out.compute_ns / 1e6))
    stop.set()
    if busy_task is not None:
        await busy_task
    trainer.close()


def run_handoff(calls: int, rounds: int) -> None:
    import uvloop

    backend = _tiny_backend()
    print(
        f"hand-off to the compute thread on uvloop, ForwardBackward on the tiny model, {calls} calls, "
        f"{rounds} rounds"
    )
    for busy in (False, True):
        times: dict[str, list[tuple[float, float]]] = {}
        for _ in range(rounds):
            uvloop.run(_handoff_round(backend, calls // rounds, busy, times))
        print(f" the loop {'busy 0.2 ms of every 2 ms' if busy else 'idle'}:")
        for name, pairs in times.items():
            handoff, compute = [p[0] for p in pairs], [p[1] for p in pairs]
            print(
                f"  {name:<44} hand-off {_quartiles(handoff)}  compute p50 {np.median(compute):6.2f} ms",
                flush=True,
            )


def run_sdk_configs(calls: int, rounds: int) -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    print(
        f"the SDK against the no-op server (httptools + uvloop) per /client/config answer, {calls} calls, "
        f"{rounds} rounds"
    )
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for _ in range(rounds):  # the configurations take turns
        for config in SDK_CONFIGS:
            times = _measure_server("httptools", "uvloop", calls, config)
            name = f"compress {config['proto_compress_fwdbwd']}, pyqwest {config['use_pyqwest_transport']}"
            wall.setdefault(name, []).extend(times["sdk"])
            cpu.setdefault(name, []).extend(times["sdk_cpu"])
    for name in wall:
        print(f"  {name:<26} wall {_quartiles(wall[name])}  client CPU {_quartiles(cpu[name])}", flush=True)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "serve-noop":  # the server process of `http` and `sdk`
        serve_noop(int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "measure-client":  # the client process of `http`
        url, calls = sys.argv[2], int(sys.argv[3])
        sdk, sdk_cpu = _sdk_times(url, calls)
        print(json.dumps({"sdk": sdk, "sdk_cpu": sdk_cpu, "raw": _raw_times(url, calls)}))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("floor", choices=("ray", "http", "sdk", "handoff"))
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.floor == "ray":
        run_ray(args.calls, args.compute_ms, args.rounds)
    elif args.floor == "http":
        run_http(args.calls, args.rounds)
    elif args.floor == "sdk":
        run_sdk_configs(args.calls, args.rounds)
    else:
        run_handoff(args.calls, args.rounds)


if __name__ == "__main__":
    main()
