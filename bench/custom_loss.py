"""A custom loss run on the server (create_custom_loss) against the SDK's client-side custom loss, through
the real tinker SDK, the gateway and a LoRA trainer on the tiny model (CPU).

    .venv/bin/python bench/custom_loss.py [--steps 8 --datums 8 --tokens 128] [--json PATH]

The loss is DPO-style, per datum: -logsigmoid(beta * sign * (sum(weights * logprobs) - ref_logprob)), with
an accuracy (`:mean`) and a margin (`:sum`) metric. Two LoRA training clients of one session start from the
same seed; each step, one runs `forward_backward_custom(data, handle)` (uploaded: one forward_backward on
the trainer) and the other `forward_backward_custom(data, fn)` (client-side: a forward, the loss and its
gradient here, then a backward with weights -dC/dlogp), alternating which goes first, then both take the
same optim_step. Reported: the median forward_backward_custom latency of each and their ratio, and the
largest difference between the two in logprobs, loss and metrics (they must agree: exit 1 if not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.* as a package
from bench.multi_tenant_latency import KEYS, MODEL, serve
from miles.models.tiny import build_tiny_model

RANKS = {"logprobs": 1, "weights": 1, "ref_logprob": 0, "sign": 0}
TOLERANCE = 1e-4


def dpo_style(logprobs, weights, ref_logprob, sign):
    """Per datum: weights [T], ref_logprob and sign scalars (tests/fast/gateway/test_custom_loss_sdk.py
    trains with it too)."""
    policy = (logprobs * weights).sum()
    margin = 0.1 * sign * (policy - ref_logprob)
    loss = -F.logsigmoid(margin)
    return loss, {"custom/accuracy:mean": (margin > 0).float(), "custom/margin:sum": margin.detach()}


def client_side(data: list[types.Datum], logprobs_list: list[torch.Tensor]):
    """dpo_style as a plain forward_backward_custom callable: the SDK runs it in this process."""
    total, sums = None, {}
    for datum, logprobs in zip(data, logprobs_list, strict=True):
        inputs = [datum.loss_fn_inputs[k].to_torch() for k in ("weights", "ref_logprob", "sign")]
        loss, metrics = dpo_style(logprobs, *inputs)
        total = loss if total is None else total + loss
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


def batch(seed: int, datums: int, tokens: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for i in range(datums):
        row = rng.integers(3, 1000, tokens + 1).tolist()
        inputs = {
            "target_tokens": row[1:],
            "weights": types.TensorData.from_numpy((np.arange(tokens) >= tokens // 2).astype(np.float32)),
            "ref_logprob": types.TensorData(data=[-7.0 * tokens / 2], dtype="float32", shape=[]),
            "sign": types.TensorData(data=[1.0 if i % 2 else -1.0], dtype="float32", shape=[]),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(row[:-1]), loss_fn_inputs=inputs))
    return data


def timed(run) -> tuple[Any, float]:
    began = time.perf_counter()
    out = run()
    return out, time.perf_counter() - began


def differences(a: types.ForwardBackwardOutput, b: types.ForwardBackwardOutput) -> float:
    worst = max(
        abs(a.metrics[k] - b.metrics[k]) for k in ("loss:sum", "custom/accuracy:mean", "custom/margin:sum")
    )
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        worst = max(
            worst, float(np.abs(np.asarray(x["logprobs"].data) - np.asarray(y["logprobs"].data)).max())
        )
    return worst


def run(url: str, steps: int, datums: int, tokens: int) -> dict[str, Any]:
    service = tinker.ServiceClient(base_url=url, api_key=KEYS[0])
    handle = service.create_custom_loss(dpo_style, RANKS).result()
    assert handle.loss_id is not None, "the gateway did not take the loss server-side"
    server = service.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
    local = service.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
    seconds: dict[str, list[float]] = {"server": [], "client": []}
    worst = 0.0
    for step in range(steps + 1):  # step 0 warms both paths up and is not counted
        data = batch(step, datums, tokens)
        order = [("server", server, handle), ("client", local, client_side)]
        outputs = {}
        for name, client, loss in order if step % 2 else order[::-1]:
            outputs[name], took = timed(
                lambda c=client, fn=loss, d=data: c.forward_backward_custom(d, fn).result()
            )
            if step:
                seconds[name].append(took)
        worst = max(worst, differences(outputs["server"], outputs["client"]))
        for client in (server, local):
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "steps": steps,
        "datums": datums,
        "tokens": tokens,
        "seconds": seconds,
        "median_s": medians,
        "client_over_server": medians["client"] / medians["server"],
        "largest_difference": worst,
        "same_results": worst <= TOLERANCE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with console.status("building the tiny model, starting the CPU engine and the gateway"):
            model_dir = build_tiny_model(work / "model")
        with serve(model_dir, work) as (url, _), console.status(f"{args.steps} steps, each path once a step"):
            result = run(url, args.steps, args.datums, args.tokens)
    table = Table(title=f"custom loss, {args.datums} datums x {args.tokens} tokens, median of {args.steps}")
    for column in ("path", "requests per step", "forward_backward_custom"):
        table.add_column(column)
    table.add_row("server-side (create_custom_loss)", "1", f"{result['median_s']['server'] * 1e3:.1f} ms")
    table.add_row(
        "client-side (forward_backward_custom)", "2", f"{result['median_s']['client'] * 1e3:.1f} ms"
    )
    console.print(table)
    console.print(
        f"client-side / server-side: {result['client_over_server']:.2f}x; largest difference in logprobs, "
        f"loss and metrics {result['largest_difference']:.2e} (same results: {result['same_results']})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    raise SystemExit(0 if result["same_results"] else 1)


if __name__ == "__main__":
    main()
