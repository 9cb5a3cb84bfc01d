"""Gateway benchmark: where one forward_backward's time goes, and throughput under concurrent clients.

    .venv/bin/python bench/gateway.py [--runtime local|ray|ray-actor-calls|both ...] [--steps 40]
    .venv/bin/python bench/gateway.py --runtime local --clients 8 32 [--rounds 3 --seconds 10]

Overhead mode (the default) runs the real tinker SDK against the gateway over the local runtime
(`python -m miles.driver.local_server`) and/or the production Ray runtime (`ray_gateway_server.py`: a
trainer cell and a CPU engine cell on a local Ray), tiny model, and in the same run, interleaved step by
step, the same forward_backward on a TransformersBackend called directly (the baseline). Prints, per
runtime, the median of each stage the gateway timed (the `X-Miles-Stages` header of `retrieve_future`,
see miles/gateway/stages.py), the rest (SDK, HTTP and framework: the SDK's wall time less every server
stage), and the paired overhead (SDK wall - direct call, step by step): median and interquartile range.
`ray-actor-calls` is the Ray runtime with `runtime.trainer_channel=false`: its trainer commands go as Ray
actor calls instead of over the command channel (miles/train/channel.py), the baseline for that path.

Load mode (`--clients N ...`) runs N SDK training clients (threads of one ServiceClient, one LoRA model
each) doing forward_backward + optim_step steps for `--seconds`, each client count in turn, `--rounds`
times interleaved, and prints steps/s per count (median, min-max) and the ratio to the first count.

The gateways' LoRA batching window (`--lora-batch-window-ms`) is 0 in overhead mode: the SDK's model and
the httpx client's take turns, so with a window each forward_backward would wait it out for the other
(batching's cost, measured with its gain by bench/multi_tenant.py, not the gateway's overhead). Load mode
keeps the default 5 ms: its clients are the tenants a window is for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from miles.gateway.stages import parse_stages
from miles.models.tiny import build_tiny_model
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.coalescer import DEFAULT_WINDOW_S
from miles.types import Datum, LoraSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* as a package
from bench.gateway_process import BASE_MODEL, GatewayProcess, start_gateway, start_ray_gateway

KEY = "tml-bench-gateway-0001"
STAGES = (
    "http_in",
    "decode",
    "admit",
    "queue_wait",
    "mark_running",
    "prepare",
    "dispatch",
    "compute",
    "encode",
    "publish",
    "notify",
)
ADAM = types.AdamParams(learning_rate=1e-4)
# ray-actor-calls: the Ray runtime with runtime.trainer_channel off (its trainer commands as actor calls)
RUNTIMES = ("local", "ray", "ray-actor-calls")


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = np.percentile(np.asarray(values), [25, 50, 75])
    return float(q1), float(q2), float(q3)


def _data(rows: list[list[int]]) -> tuple[list[types.Datum], list[Datum]]:
    sdk, direct = [], []
    for row in rows:
        inputs = {"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)}
        sdk.append(types.Datum(model_input=types.ModelInput.from_ints(row[:-1]), loss_fn_inputs=inputs))
        direct.append(
            Datum(
                model_input=np.asarray(row[:-1], np.int64),
                loss_fn_inputs={
                    k: np.asarray(v, np.float32 if k == "weights" else np.int64) for k, v in inputs.items()
                },
            )
        )
    return sdk, direct


def _start(runtime: str, model_dir: Path, work: Path, window_ms: float) -> GatewayProcess:
    flags = [f"--lora-batch-window-ms={window_ms:g}"]
    if runtime == "local":
        return start_gateway(model_dir, work / f"gw-{runtime}", {KEY: "bench"}, *flags)
    if runtime == "ray-actor-calls":
        flags.append("--no-trainer-channel")
    return start_ray_gateway(model_dir, work / f"gw-{runtime}", {KEY: "bench"}, *flags)


def _direct_call(model_dir: Path, data: list[Datum]) -> Callable[[], float]:
    backend = TransformersBackend(str(model_dir), train_mode="lora")
    backend.create_adapter("bench", LoraSpec(rank=8, seed=0))

    def call() -> float:
        start = time.perf_counter()
        backend.forward_backward("bench", data, "cross_entropy", {})
        return time.perf_counter() - start

    call()  # warm-up
    return call


def _raw_http_call(
    url: str, model_id: str, data: list[types.Datum], computes: list[float]
) -> Callable[[], float]:
    """The same forward_backward without the SDK: the body it would send (protobuf, zstd), posted with a
    plain httpx client, then one retrieve_future; what is left over the direct call is the gateway's.
    Each call appends the rank's compute (ms, the answer's `X-Miles-Stages`) to `computes`."""
    client = httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60)
    seq = iter(range(1, 1 << 30))

    def call() -> float:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=model_id,
            seq_id=next(seq),
        )
        body = zstandard.ZstdCompressor().compress(
            forward_backward_request_to_proto(request).SerializeToString()
        )
        headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
        start = time.perf_counter()
        request_id = client.post("/api/v1/forward_backward", content=body, headers=headers).json()[
            "request_id"
        ]
        answer = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": request_id},
            headers={"Accept": "application/x-protobuf"},
        )
        elapsed = time.perf_counter() - start
        if answer.headers.get("content-type") != "application/x-protobuf":
            raise RuntimeError(f"forward_backward without the SDK failed: {answer.text[:300]}")
        computes.append(parse_stages(answer.headers.get("x-miles-stages", "")).get("compute", float("nan")))
        return elapsed

    return call


def _stage_rows(gateway: GatewayProcess, steps: int) -> list[dict[str, float]]:
    polls = [
        r for r in gateway.requests()
        if r["path"] == "/api/v1/retrieve_future" and "stages" in r
        and r["headers"].get("x-tinker-request-type") == "ForwardBackward"
    ]  # fmt: skip
    return [parse_stages(p["stages"]) for p in polls][-steps:]


def measure_overhead(
    runtime: str,
    model_dir: Path,
    work: Path,
    sdk_data: list[types.Datum],
    direct: Callable[[], float],
    steps: int,
    window_ms: float,
) -> dict[str, Any]:
    gateway = _start(runtime, model_dir, work, window_ms)
    try:
        service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        # a model of its own: its seq_ids are the raw client's, never the SDK's
        raw_model = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
        raw_compute: list[float] = []
        raw = _raw_http_call(gateway.url, raw_model.model_id, sdk_data, raw_compute)
        for _ in range(3):  # warm-up
            tc.forward_backward(sdk_data, "cross_entropy").result()
            raw()
        raw_compute.clear()
        sdk_ms, raw_ms, direct_ms = [], [], []

        def sdk() -> float:
            start = time.perf_counter()
            tc.forward_backward(sdk_data, "cross_entropy").result()
            return time.perf_counter() - start

        calls = ((sdk, sdk_ms), (raw, raw_ms), (direct, direct_ms))
        for step in range(steps):
            # rotate which goes first, so none always runs on a cache another warmed
            for k in range(3):
                call, into = calls[(step + k) % 3]
                into.append(call() * 1000)
        stages = _stage_rows(gateway, steps)  # the SDK's (the raw client sends no request type)
    finally:
        gateway.stop()
    sdk_compute = [row.get("compute", float("nan")) for row in stages]
    return {
        "sdk_ms": sdk_ms,
        "raw_ms": raw_ms,
        "direct_ms": direct_ms,
        "stages": stages,
        "sdk_compute_ms": sdk_compute if len(sdk_compute) == steps else [float("nan")] * steps,
        "raw_compute_ms": raw_compute,
    }


def print_overhead(results: dict[str, dict[str, Any]], batch: int, seq_len: int, steps: int) -> None:
    runtimes = list(results)
    print(f"forward_backward, batch {batch} x {seq_len} tokens, {steps} steps each, tiny model (CPU)")
    print(f"  {'stage (p50, ms)':<34}" + "".join(f"{r:>10}" for r in runtimes))
    for stage in STAGES:
        cells = []
        for r in runtimes:
            values = [row.get(stage, 0.0) for row in results[r]["stages"]]
            cells.append(f"{statistics.median(values):>10.2f}" if values else f"{'-':>10}")
        print(f"  {stage:<34}" + "".join(cells))
    rest = []
    for r in runtimes:
        res = results[r]
        server = [sum(row.values()) for row in res["stages"]]
        rest.append(statistics.median(res["sdk_ms"]) - statistics.median(server) if server else float("nan"))
    print(f"  {'SDK, HTTP, framework (rest)':<34}" + "".join(f"{v:>10.2f}" for v in rest))
    for label, key in (
        ("SDK + gateway, submit -> result", "sdk_ms"),
        ("no SDK (httpx) + gateway", "raw_ms"),
        ("direct backend call", "direct_ms"),
    ):
        print(f"  {label:<34}" + "".join(f"{statistics.median(results[r][key]):>10.2f}" for r in runtimes))
    for label, key, base in (
        ("SDK - direct", "sdk_ms", "direct_ms"),
        ("no SDK - direct", "raw_ms", "direct_ms"),
        ("SDK - no SDK (the SDK's own cost)", "sdk_ms", "raw_ms"),
    ):
        print(f"  paired overhead ({label}, per step):")
        for r in runtimes:
            _print_paired(r, results[r][key], results[r][base])
    # The direct call computes in this process, the gateway's rank in another, at times 1-2 ms apart on a
    # busy 2-core box; over the rank's own compute of the same step, that spread is gone.
    for label, key, base in (
        ("SDK - the rank's compute", "sdk_ms", "sdk_compute_ms"),
        ("no SDK - the rank's compute", "raw_ms", "raw_compute_ms"),
    ):
        print(f"  paired overhead ({label}, per step):")
        for r in runtimes:
            _print_paired(r, results[r][key], results[r][base])


def _print_paired(runtime: str, measured: list[float], baseline: list[float]) -> None:
    diffs = [m - b for m, b in zip(measured, baseline, strict=True)]
    q1, q2, q3 = _quartiles(diffs)
    ratio = statistics.median([m / b for m, b in zip(measured, baseline, strict=True)])
    print(f"    {runtime}: p50 {q2:.2f} ms (IQR {q1:.2f} .. {q3:.2f}); ratio p50 {ratio:.2f}x")


def _client_loop(tc: Any, data: list[types.Datum], start: threading.Barrier, stop_at: list[float]) -> int:
    start.wait()
    steps = 0
    while time.perf_counter() < stop_at[0]:
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        steps += 1
    return steps


def _steps_per_s(clients: list[Any], data: list[types.Datum], seconds: float) -> float:
    start = threading.Barrier(len(clients) + 1)
    stop_at = [float("inf")]
    counts = [0] * len(clients)

    def run(i: int) -> None:
        counts[i] = _client_loop(clients[i], data, start, stop_at)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    begun = time.perf_counter()
    stop_at[0] = begun + seconds
    start.wait()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - begun)


def measure_load(
    runtime: str,
    model_dir: Path,
    work: Path,
    data: list[types.Datum],
    counts: list[int],
    rounds: int,
    seconds: float,
    window_ms: float,
) -> dict[int, list[float]]:
    gateway = _start(runtime, model_dir, work, window_ms)
    try:
        service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
        clients = [
            service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=i).result()
            for i in range(max(counts))
        ]
        for tc in clients:  # warm-up: every adapter has run once
            tc.forward_backward(data, "cross_entropy").result()
        rates: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(rounds):
            for n in counts:
                rates[n].append(_steps_per_s(clients[:n], data, seconds))
    finally:
        gateway.stop()
    return rates


def print_load(runtime: str, rates: dict[int, list[float]], seconds: float) -> None:
    counts = list(rates)
    base = statistics.median(rates[counts[0]])
    print(f"load, {runtime} runtime: forward_backward + optim_step per step, {seconds:.0f} s per measurement")
    for n in counts:
        values = rates[n]
        ratios = [v / b for v, b in zip(values, rates[counts[0]], strict=True)]
        print(
            f"  {n:>3} clients: {statistics.median(values):6.1f} steps/s (min {min(values):.1f}, max "
            f"{max(values):.1f}); vs {counts[0]} clients {statistics.median(values) / base:.2f}x "
            f"(per round {min(ratios):.2f} .. {max(ratios):.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runtime",
        nargs="+",
        choices=(*RUNTIMES, "both"),
        default=["both"],
        help="one or more, measured in turn in one run; both = local ray",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="*", help="load mode: these client counts, in turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--lora-batch-window-ms",
        type=float,
        default=None,
        help="the gateways' LoRA batching window; default 0 in overhead mode (its SDK and httpx models take "
        "turns, so each would wait the window for the other: batching, not overhead), 5 in load mode",
    )
    args = parser.parse_args()
    window_ms = args.lora_batch_window_ms
    if window_ms is None:
        window_ms = DEFAULT_WINDOW_S * 1000 if args.clients else 0.0
    torch.set_num_threads(1)
    # the SDK's telemetry batches post in the background and complain once the gateway has stopped
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model_dir = build_tiny_model(work / "model")
    rng = np.random.default_rng(0)
    rows = [rng.integers(10, 1000, size=args.seq_len + 1).tolist() for _ in range(args.batch)]
    sdk_data, direct_data = _data(rows)
    runtimes = list(
        dict.fromkeys(r for name in args.runtime for r in (("local", "ray") if name == "both" else (name,)))
    )
    if args.clients:
        for runtime in runtimes:
            rates = measure_load(
                runtime, model_dir, work, sdk_data, args.clients, args.rounds, args.seconds, window_ms
            )
            print(f"LoRA batching window {window_ms:g} ms")
            print_load(runtime, rates, args.seconds)
        return
    direct = _direct_call(model_dir, direct_data)
    results = {
        r: measure_overhead(r, model_dir, work, sdk_data, direct, args.steps, window_ms) for r in runtimes
    }
    print(f"LoRA batching window {window_ms:g} ms")
    print_overhead(results, args.batch, args.seq_len, args.steps)


if __name__ == "__main__":
    sys.exit(main())
