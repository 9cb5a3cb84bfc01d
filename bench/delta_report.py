"""The delta push benchmarks' rows and summary (bench/push.py --delta on CPU with Ray, bench/push_nccl.py
--delta on a GPU): per push pair, the delta push against the full push of the same weights and a raw
broadcast of the same bucket sizes; per learning rate, medians with their spread."""

from __future__ import annotations

import statistics
import time
from typing import Any


async def timed_pair(push: Any, deltas: Any, full: Any) -> tuple[Any, float, Any, float]:
    """Right after a step: the delta push (config `deltas`), then the full push of the same weights
    (`full`), each timed; `push(config)` runs one push and returns its report."""
    start = time.perf_counter()
    sent = await push(deltas)
    delta_s = time.perf_counter() - start
    start = time.perf_counter()
    whole = await push(full)
    full_s = time.perf_counter() - start
    if sent.mode != "send" or not sent.verified or whole.mode != "off":
        raise SystemExit(f"expected a verified delta push and a full one, got {sent.mode} {sent.verified}")
    return sent, delta_s, whole, full_s


def delta_row(sent, delta_s: float, whole, full_s: float, raw_s: float) -> dict:
    forms: dict[str, int] = {}
    for bucket in sent.bucket_timings:
        forms[bucket.form] = forms.get(bucket.form, 0) + 1
    return {
        "delta_s": delta_s,
        "full_s": full_s,
        "raw_s": raw_s,
        "delta_bytes": sent.bytes,
        "full_bytes": whole.bytes,
        "density": sent.density,
        "forms": forms,
        "verified": sent.verified,
        "encode_s": sum(b.encode_s for b in sent.bucket_timings),
        "verify_s": sent.steps.get("verify", 0.0),
        "delta_breakdown": sent.breakdown(),
        "full_breakdown": whole.breakdown(),
    }


def delta_line(lr: float, row: dict) -> str:
    mib = 2**20
    return (
        f"lr {lr:g}: density {row['density']:.4f} forms {row['forms']} | "
        f"delta {row['delta_bytes'] / mib:.1f} MiB in {row['delta_s']:.3f} s "
        f"(encode {row['encode_s']:.3f}, verify {row['verify_s']:.3f}) | "
        f"full {row['full_bytes'] / mib:.1f} MiB in {row['full_s']:.3f} s | raw {row['raw_s']:.3f} s | "
        f"full/delta {row['full_s'] / row['delta_s']:.2f}x, "
        f"bytes {row['full_bytes'] / row['delta_bytes']:.2f}x"
        f", full/raw time {row['raw_s'] / row['full_s']:.2f}"
    )


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def delta_summary(results: dict[float, list[dict]]) -> dict:
    summary = {}
    for lr, rows in results.items():
        summary[str(lr)] = {
            "speedup_full_over_delta": spread([r["full_s"] / r["delta_s"] for r in rows]),
            "bytes_full_over_delta": spread([r["full_bytes"] / r["delta_bytes"] for r in rows]),
            "full_push_over_raw": spread([r["raw_s"] / r["full_s"] for r in rows]),
            "density": spread([r["density"] for r in rows]),
            "all_verified": all(r["verified"] for r in rows),
            "rows": rows,
        }
    return summary


def print_summary(summary: dict, file: Any = None) -> None:
    """One line per lr (`file`: stdout by default; stderr when stdout carries the JSON)."""
    for lr, row in summary.items():
        speedup = row["speedup_full_over_delta"]
        print(
            f"lr {lr}: full/delta time {speedup['median']:.2f}x ({speedup['min']:.2f}-{speedup['max']:.2f}), "
            f"bytes {row['bytes_full_over_delta']['median']:.2f}x, full push/raw "
            f"{row['full_push_over_raw']['median']:.2f}, density {row['density']['median']:.4f}, "
            f"bit-exact (digest) {row['all_verified']}",
            file=file,
            flush=True,
        )
