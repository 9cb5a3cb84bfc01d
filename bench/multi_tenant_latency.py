"""What the LoRA batching window costs a tenant, through the real tinker SDK, tiny model, CPU.

    .venv/bin/python bench/multi_tenant_latency.py [--rounds 5 --steps 15 --tokens 128]

The gateway (in this process, on loopback) serves a LocalRuntime; up to 4 API keys, one LoRA training
client each (ranks 2, 4, 8, 16). A step is forward_backward + optim_step on 2 rows of `--tokens` tokens.
Three coalescer settings, switched on the same runtime and interleaved round by round (each round starting
at the next one, so that none always runs first):
  off       window 0: every request its own trainer command (the baseline);
  wait-all  window 5 ms, every model that ever sent a request counts as a companion (the coalescer before
            it learnt idleness: it waited for every loaded model);
  adaptive  window 5 ms, only models that sent in the last second count (the default).
Three scenarios: (a) one tenant loaded; (b) that tenant active while three others are loaded and idle
(each sent one step, then nothing); (c) all four training at once. Prints per scenario and setting the
median forward_backward latency (SDK wall, submit to result) and tokens/s over all tenants, with the ratio
to `off`, and the time the coalescer spent waiting for companions per request (coalescer.stats.waited_s):
what the decision cost, far less noisy than wall times on a shared machine, and how many requests a trainer
command carried.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types

from miles.checkpoints.manager import CheckpointManager
from miles.engines.config import EngineConfig
from miles.engines.process import EngineProcess
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.server import embedded_gateway_server
from miles.gateway.settings import GatewaySettings
from miles.models.tiny import build_tiny_model
from miles.runtime.local import LocalRuntime
from miles.state import MemoryStateStore
from miles.train.backends.transformers_backend import TransformersBackend
from miles.train.coalescer import DEFAULT_ACTIVE_S, DEFAULT_WINDOW_S
from miles.utils.serving import free_port

MODEL = "tiny"
KEYS = [f"tml-bench-latency-{i}" for i in range(4)]
RANKS = (2, 4, 8, 16)
SETTINGS = {  # name -> (window_s, active_s)
    "off": (0.0, DEFAULT_ACTIVE_S),
    "wait-all": (DEFAULT_WINDOW_S, math.inf),
    "adaptive": (DEFAULT_WINDOW_S, DEFAULT_ACTIVE_S),
}


@contextmanager
def serve(model_dir: Path, work: Path) -> Iterator[tuple[str, LocalRuntime]]:
    engine = EngineProcess(
        EngineConfig(model_path=str(model_dir), kind="cpu", api_key=secrets.token_hex(16)), host="127.0.0.1"
    )
    engine.start(str(work / "engine.log"))
    try:
        asyncio.run(engine.wait_healthy(timeout_s=180.0))
        backend = TransformersBackend(str(model_dir), train_mode="lora")
        runtime = LocalRuntime(model_dir, model_name=MODEL, engine=engine, backend=backend)
        store = MemoryStateStore()
        keys = ApiKeys({key: f"tenant{i}" for i, key in enumerate(KEYS)})
        app = create_app(runtime, store, CheckpointManager(work / "ckpt", store), keys, GatewaySettings())
        port = free_port()
        server = embedded_gateway_server(app, "127.0.0.1", port)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}", runtime
        finally:
            server.should_exit = True
            thread.join(15)
    finally:
        engine.stop()


def batch(seed: int, tokens: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 1000, tokens + 1).tolist() for _ in range(2)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * tokens},
        )
        for r in rows
    ]


def train(client, data: list[types.Datum], steps: int, start: threading.Barrier, out: list[float]) -> None:
    """`steps` steps; appends each forward_backward's latency (s) to `out`."""
    start.wait()
    for _ in range(steps):
        began = time.perf_counter()
        client.forward_backward(data, "cross_entropy").result(timeout=120)
        out.append(time.perf_counter() - began)
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=120)


def run_round(clients, data, steps: int) -> tuple[list[float], float]:
    """All `clients` train `steps` steps at once: (forward_backward latencies, wall seconds)."""
    latencies: list[list[float]] = [[] for _ in clients]
    start = threading.Barrier(len(clients) + 1)
    threads = [
        threading.Thread(target=train, args=(c, d, steps, start, out))
        for c, d, out in zip(clients, data, latencies, strict=True)
    ]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return [x for out in latencies for x in out], time.perf_counter() - began


def measure(runtime, clients, data, args) -> dict[str, tuple[float, float, float, float]]:
    """setting -> (median forward_backward ms, tokens/s, ms waited in the window per request, requests per
    trainer command), rounds interleaved across the settings, each round starting at the next setting."""
    latencies: dict[str, list[float]] = {name: [] for name in SETTINGS}
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    waited = dict.fromkeys(SETTINGS, 0.0)
    commands = dict.fromkeys(SETTINGS, 0)
    stats = runtime.coalescer.stats
    names = list(SETTINGS)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            runtime.coalescer.window_s, runtime.coalescer.active_s = SETTINGS[name]
            before = (stats.waited_s, stats.commands)
            got, wall = run_round(clients, data, args.steps)
            waited[name] += stats.waited_s - before[0]
            commands[name] += stats.commands - before[1]
            latencies[name] += got
            rates[name].append(len(clients) * args.steps * 2 * args.tokens / wall)
    requests = args.rounds * len(clients) * args.steps * 2  # forward_backward and optim_step
    return {
        name: (
            1000 * statistics.median(latencies[name]),
            statistics.median(rates[name]),
            1000 * waited[name] / requests,
            requests / commands[name],
        )
        for name in names
    }


def report(scenario: str, results: dict[str, tuple[float, float, float, float]]) -> None:
    base_ms, base_rate, _, _ = results["off"]
    for name, (ms, rate, waited_ms, merged) in results.items():
        print(
            f"{scenario:<22} {name:<9} fb p50 {ms:7.2f} ms ({ms / base_ms:5.2f}x off)   "
            f"{rate:9.0f} tokens/s ({rate / base_rate:5.2f}x off)   window waited {waited_ms:5.2f} ms/request"
            f"   {merged:4.2f} requests/command"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15, help="steps per tenant per round and setting")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row (2 rows a batch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "model")
        with serve(model_dir, work) as (url, runtime):

            def client(i: int):
                service = tinker.ServiceClient(base_url=url, api_key=KEYS[i])
                return service.create_lora_training_client(base_model=MODEL, rank=RANKS[i], seed=i)

            data = [batch(i, args.tokens) for i in range(len(KEYS))]
            print(f"tiny model, 2 x {args.tokens} tokens a batch, {args.rounds} rounds x {args.steps} steps")
            tenants = [client(0)]  # (a): the only model loaded
            report("(a) one tenant", measure(runtime, tenants, data[:1], args))
            tenants += [client(i) for i in range(1, len(KEYS))]
            # (b) the three others sent one step each and went idle (longer ago than active_s)
            runtime.coalescer.window_s = DEFAULT_WINDOW_S
            run_round(tenants[1:], data[1:], 1)
            time.sleep(DEFAULT_ACTIVE_S + 0.2)
            report("(b) 1 active + 3 idle", measure(runtime, tenants[:1], data[:1], args))
            report("(c) 4 active", measure(runtime, tenants, data, args))
            print("coalescer", runtime.coalescer.stats)


if __name__ == "__main__":
    main()
