"""A trainer command's round trip: over the command channel against Ray actor calls, side by side (issue 24).

    .venv/bin/python bench/trainer_dispatch.py [--calls 60] [--ranks 1] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--batch 4] [--seq-len 64] [--json]

Two trainer cells on one local Ray, each training one LoRA adapter on the tiny model: one sends its
commands over the ranks' command channels (miles/train/channel.py), the other as `TrainerWorker.execute`
actor calls (`command_channel=False`, what `runtime.trainer_channel: false` runs). The same real
ForwardBackward (plus an OptimStep, so the adapter moves as in training) goes to one cell and then the
other, `--calls` times, the first cell alternating. Per path: the wall time of `cell.run`, the rank's own
compute (`ForwardBackwardOutput.compute_ns`), and dispatch = wall - compute, p50 (IQR), and the ratio of
the dispatches. On CPU the GPUs are Ray's logical ones; with `--device cuda` both cells' ranks share the
GPUs (half a GPU each), computing in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group

from miles.models.tiny import build_tiny_model
from miles.train.cell import TrainerCell
from miles.train.commands import CreateAdapter, OptimStep
from miles.types import AdamParams, LoraSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_floors import forward_backward_command

PATHS = ("channel", "actor calls")
ADAM = AdamParams(learning_rate=1e-4)


def _quartiles(values: list[float]) -> dict[str, float]:
    q1, q2, q3 = np.percentile(np.asarray(values), [25, 50, 75])
    return {"p50": float(q2), "q1": float(q1), "q3": float(q3)}


async def _cells(args: argparse.Namespace, model_dir: Path) -> dict[str, TrainerCell]:
    gpu_share = 0.5 if args.device == "cuda" else 1.0
    pg = placement_group([{"GPU": gpu_share, "CPU": 1}] * (2 * args.ranks))
    await pg.ready()
    cells = {
        "channel": TrainerCell(0, num_gpus_per_actor=gpu_share),
        "actor calls": TrainerCell(1, num_gpus_per_actor=gpu_share, command_channel=False),
    }
    for i, cell in enumerate(cells.values()):
        bundles = [(pg, i * args.ranks + r) for r in range(args.ranks)]
        await cell.start(
            bundles, model_path=str(model_dir), train_mode="lora", device=args.device, dtype=args.dtype
        )
        await cell.run(CreateAdapter("bench", LoraSpec(rank=8, seed=0)))
    for path, cell in cells.items():
        if cell.command_path != path:
            raise SystemExit(f"the {path!r} cell runs its commands as {cell.command_path!r}")
    return cells


async def _measure(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    cells = await _cells(args, model_dir)
    command = forward_backward_command(args.batch, args.seq_len)
    wall: dict[str, list[float]] = {path: [] for path in PATHS}
    compute: dict[str, list[float]] = {path: [] for path in PATHS}
    for call in range(args.warmup + args.calls):
        order = PATHS if call % 2 == 0 else PATHS[::-1]
        for path in order:
            start = time.perf_counter()
            out = await cells[path].run(command)
            elapsed = (time.perf_counter() - start) * 1000
            await cells[path].run(OptimStep("bench", ADAM))
            if call >= args.warmup:
                wall[path].append(elapsed)
                compute[path].append(out.compute_ns / 1e6)
    for cell in cells.values():
        await cell.stop()
    rows = {}
    for path in PATHS:
        dispatch = [w - c for w, c in zip(wall[path], compute[path], strict=True)]
        rows[path] = {
            "wall_ms": _quartiles(wall[path]),
            "compute_ms": _quartiles(compute[path]),
            "dispatch_ms": _quartiles(dispatch),
        }
    ratio = rows["channel"]["dispatch_ms"]["p50"] / rows["actor calls"]["dispatch_ms"]["p50"]
    return {"setup": vars(args), "paths": rows, "dispatch_ratio_channel_to_actor_calls": ratio}


def _print(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print(
        f"ForwardBackward, batch {setup['batch']} x {setup['seq_len']} tokens, {setup['ranks']} rank(s), "
        f"{setup['device']} {setup['dtype']}, {setup['calls']} calls per path"
    )
    for path, row in result["paths"].items():
        cells = "  ".join(
            f"{name[:-3]} {row[name]['p50']:7.2f} ({row[name]['q1']:.2f} .. {row[name]['q3']:.2f})"
            for name in ("wall_ms", "compute_ms", "dispatch_ms")
        )
        print(f"  {path:<12} ms, p50 (IQR): {cells}")
    print(f"  dispatch, channel / actor calls: {result['dispatch_ratio_channel_to_actor_calls']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    if args.calls < 1 or args.ranks < 1:
        parser.error("--calls and --ranks must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    model_dir = build_tiny_model(work / "model")
    gpus = None if args.device == "cuda" else 2 * args.ranks  # logical on CPU; the real ones on CUDA
    ray.init(num_cpus=2 * args.ranks + 1, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(_measure(args, model_dir))
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return None


if __name__ == "__main__":
    sys.exit(main())
