"""Gateway benchmark: completion-to-client latency of futures and per-forward_backward overhead.

    .venv/bin/python bench/gateway.py [--steps 30]

Runs the real tinker SDK against `python -m miles.runtime.local_server` (local runtime, tiny model) and in the
same run, the same forward_backward on a TransformersBackend called directly. Prints:
- latency from the moment an operation's result is written to the moment the SDK's `.result()` returns
  (p50/p95), next to the operation's own duration as the baseline;
- wall time per forward_backward through the SDK + gateway vs the direct backend call (ratio, overhead).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types

from miles.models.tiny import build_tiny_model
from miles.train.backends.transformers_backend import TransformersBackend
from miles.types import Datum, LoraSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "system" / "helpers"))
from gateway_process import BASE_MODEL, start_gateway

KEY = "tml-bench-gateway-0001"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model_dir = build_tiny_model(work / "model")
    rng = np.random.default_rng(0)
    rows = [rng.integers(10, 1000, size=args.seq_len + 1).tolist() for _ in range(args.batch)]
    sdk_data, direct_data = _data(rows)

    gateway = start_gateway(model_dir, work / "gw", {KEY: "bench"})
    try:
        tc = (
            tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
            .create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0)
            .result()
        )
        tc.forward_backward(sdk_data, "cross_entropy").result()  # warm-up
        seen_at, sdk_wall = [], []
        for _ in range(args.steps):
            start = time.time()
            tc.forward_backward(sdk_data, "cross_entropy").result()
            seen_at.append(time.time())
            sdk_wall.append(seen_at[-1] - start)
        polls = [
            r for r in gateway.requests()
            if r["path"] == "/api/v1/retrieve_future" and "completed_at" in r
            and r["headers"].get("x-tinker-request-type") == "ForwardBackward"
        ]  # fmt: skip
        completed = [p["completed_at"] for p in polls][-args.steps :]
    finally:
        gateway.stop()

    backend = TransformersBackend(str(model_dir), train_mode="lora")
    backend.create_adapter("bench", LoraSpec(rank=8, seed=0))
    backend.forward_backward("bench", direct_data, "cross_entropy", {})
    direct_wall = []
    for _ in range(args.steps):
        start = time.perf_counter()
        backend.forward_backward("bench", direct_data, "cross_entropy", {})
        direct_wall.append(time.perf_counter() - start)

    latency_ms = [(s - c) * 1000 for s, c in zip(seen_at, completed, strict=True)]
    sdk_ms = statistics.median(sdk_wall) * 1000
    direct_ms = statistics.median(direct_wall) * 1000
    print(
        f"forward_backward, batch {args.batch} x {args.seq_len} tokens, {args.steps} steps, tiny model (CPU)"
    )
    p50, p95 = _pct(latency_ms, 50), _pct(latency_ms, 95)
    print(f"  completion -> SDK sees result: p50 {p50:.1f} ms, p95 {p95:.1f} ms")
    print(f"  direct backend call (baseline): median {direct_ms:.1f} ms")
    print(f"  SDK + gateway, submit -> result: median {sdk_ms:.1f} ms")
    print(
        f"  ratio gateway/direct: {sdk_ms / direct_ms:.2f}x; overhead per call: {sdk_ms - direct_ms:.1f} ms"
    )
    print(f"  notification latency / direct compute: {p50 / direct_ms:.2f}")


if __name__ == "__main__":
    sys.exit(main())
