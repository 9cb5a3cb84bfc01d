"""The delta push's check: `delta.digest_many` per tensor vs packed, on one device, over a model's tensors.

    python bench/digest.py                      # Qwen3-0.6B's shape in bf16 on CUDA (311 tensors, 1.19 GB)
    python bench/digest.py --device cpu --json  # the same on the CPU (packing is off there by default)

Both sides digest the same tensors in the same run (a warm-up pass each first); the table gives the
seconds per pass (median of --repeats) and the ratio, and the run fails if the two give other numbers.
A delta push digests every tensor twice (the trainer's image and the engine's weights), so on a GPU the
per-tensor path's time, bound by kernel launches, was most of a small delta push's check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from train_throughput import SHAPES  # noqa: E402

from miles.utils import delta  # noqa: E402


def model_tensors(shape: str, device: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPES[shape]), dtype=torch.bfloat16)
    return [(name, p.detach()) for name, p in net.named_parameters()]


def seconds(named: list[tuple[str, torch.Tensor]], packed: bool, device: str) -> tuple[float, dict]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    digests = delta.digest_many(named, packed=packed)  # ends in a host sync: the numbers are on the host
    return time.perf_counter() - start, digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    named = model_tensors(args.shape, args.device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    times: dict[str, list[float]] = {"per_tensor": [], "packed": []}
    results = {}
    for repeat in range(args.repeats + 1):
        for variant in times:
            took, results[variant] = seconds(named, variant == "packed", args.device)
            if repeat:  # the first pass of each is a warm-up (weight tables, allocator, kernels)
                times[variant].append(took)
    if results["packed"] != results["per_tensor"]:
        print("packed and per-tensor digests differ", file=sys.stderr)
        return 1
    median = {variant: statistics.median(values) for variant, values in times.items()}
    report = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "shape": args.shape,
        "tensors": len(named),
        "bytes": nbytes,
        "seconds": times,
        "median_s": median,
        "per_tensor_over_packed": median["per_tensor"] / median["packed"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    size = f"{len(named)} tensors, {nbytes / 1e9:.2f} GB"
    print(f"{report['device']}: {args.shape}, {size}, median of {args.repeats}")
    for variant, value in median.items():
        print(f"  {variant:<10} {value * 1e3:8.1f} ms  ({nbytes / value / 1e9:.1f} GB/s)")
    print(f"  per-tensor / packed: {report['per_tensor_over_packed']:.2f}x (the digests agree)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
