"""Where an RL-style step's time goes, read from the session trace (export_session_trace), through the real
tinker SDK, the gateway, a LoRA trainer and the CPU engine on the tiny model.

    .venv/bin/python bench/session_trace.py [--steps 5 --prompts 4 --samples 4 --tokens 32] [--json PATH]

Each step: save_weights_and_get_sampling_client, `prompts` prompts x `samples` samples of `tokens` tokens,
a forward_backward (importance_sampling) on those sequences and an optim_step. The trace is then exported
and each span's median reported by category and name: the gateway's operations and stages, the queue wait,
each trainer rank's compute, the adapter load (push) and the engine's own generation time, and how much of
a Sample operation the engine's generation is (the rest: the gateway, the runtime and HTTP).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import tinker
from rich.console import Console
from rich.table import Table
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* as a package
from bench.multi_tenant_latency import KEYS, MODEL, serve
from miles.models.tiny import build_tiny_model


def run_steps(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The workload; the exported trace's complete ("X") events."""
    service = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    client = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
    prompts = [types.ModelInput.from_ints([5 + p, 17, 42, 9 + p]) for p in range(args.prompts)]
    for _ in range(args.steps):
        sampler = client.save_weights_and_get_sampling_client()
        futures = [(p, sampler.sample(p, args.samples, params)) for p in prompts]
        data = []
        for prompt, future in futures:
            for sequence in future.result().sequences:
                tokens = prompt.to_ints() + list(sequence.tokens)
                n = len(tokens) - 1
                inputs = {
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * (len(prompt.to_ints()) - 1) + list(sequence.logprobs or [0.0] * n),
                    "advantages": [0.0] * (len(prompt.to_ints()) - 1) + [1.0] * len(sequence.tokens),
                }
                data.append(
                    types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
                )
        client.forward_backward(data, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    link = service.create_rest_client().export_session_trace(service.holder.get_session_id()).result()
    with urllib.request.urlopen(link) as answer:
        return [e for e in json.load(answer)["traceEvents"] if e["ph"] == "X"]


def medians(events: list[dict[str, Any]]) -> dict[str, float]:
    """`category/name` -> median duration in ms."""
    by_key: dict[str, list[float]] = {}
    for event in events:
        by_key.setdefault(f"{event['cat']}/{event['name']}", []).append(event["dur"] / 1e3)
    return {key: statistics.median(values) for key, values in sorted(by_key.items())}


def engine_share(events: list[dict[str, Any]]) -> float:
    """Median fraction of a Sample operation spent in the engine's generation (matched by request id)."""
    samples = {
        e["args"]["request_id"]: e["dur"] for e in events if e["cat"] == "operation" and e["name"] == "Sample"
    }
    shares = [e["dur"] / samples[e["args"]["request_id"]] for e in events if e["cat"] == "engine"]
    return statistics.median(shares) if shares else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        with serve(model_dir, Path(tmp)) as (url, _):
            events = run_steps(url, args)
    result = {
        "medians_ms": medians(events),
        "engine_share_of_sample": engine_share(events),
        "args": vars(args),
    }
    table = Table(title="session trace: median span (ms)")
    table.add_column("category/name")
    table.add_column("median ms", justify="right")
    for key, value in result["medians_ms"].items():
        table.add_row(key, f"{value:.2f}")
    console = Console()
    console.print(table)
    console.print(f"engine generation / Sample operation (median): {result['engine_share_of_sample']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
