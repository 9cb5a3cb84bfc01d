"""Job lifecycle timings on the real local Slurm cluster: submit -> healthy, and trainer death -> job end.

    source /tmp/slurm-local/env.sh
    .venv/bin/python bench/lifecycle.py [--runs 3] [--nodes 3] [--json]

Each run submits a 3-node CPU-engine job through `launcher submit --scheduler slurm` (the real driver,
trainer and engines on the tiny model), waits until `launcher status` reports healthz 200, SIGKILLs the
trainer rank (its pid from RUN_DIR/cells.json), and waits until Slurm reports the job finished. The
baseline printed beside it is the watchdog-only bound for the same preset: dead_probes x probe interval,
the time the job would take to end if the driver did not exit by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "system" / "helpers"))

from jobtools import launcher_json, slurm_unavailable, system_preset  # noqa: E402

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def bench_preset(nodes: int) -> dict:
    preset = system_preset("bench-lifecycle", nodes=nodes, train_nodes=1)
    del preset["driver"]  # the real driver
    preset["gpus_per_node"] = 1
    preset["scheduler"]["slurm"]["time"] = "00:10:00"
    preset["watchdog"] |= {"dead_probes": 4, "probe_interval_s": 5.0, "startup_timeout_s": 600}
    preset["ray"] |= {"num_cpus": 2, "object_store_memory_mb": 100}
    return preset


def poll(run_id: str, until, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = launcher_json("status", run_id)
        if until(status):
            return status
        time.sleep(0.25)
    raise TimeoutError(f"{run_id}: condition not met within {timeout_s} s")


def one_run(nodes: int, workdir: Path) -> dict[str, float]:
    import yaml

    path = workdir / f"bench-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(bench_preset(nodes)))
    t0 = time.monotonic()
    sub = launcher_json("submit", "--preset", str(path), "--scheduler", "slurm")
    try:
        poll(sub["run_id"], lambda s: (s["healthz"] or {}).get("status_code") == 200, 600)
        healthy = time.monotonic() - t0
        cells = json.loads((Path(sub["run_dir"]) / "cells.json").read_text())
        t1 = time.monotonic()
        os.kill(int(cells["trainer"][0]["pid"]), signal.SIGKILL)
        final = poll(sub["run_id"], lambda s: s["state"] in FINISHED, 300)
        ended = time.monotonic() - t1
    finally:
        subprocess.run(["scancel", sub["job_id"]], capture_output=True, timeout=30)
    return {"submit_to_healthy_s": healthy, "death_to_end_s": ended, "exit_code": final["exit_code"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = slurm_unavailable()
    if reason:
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp:
        os.environ["MILES_RUNS_DIR"] = tmp
        runs = []
        for i in range(args.runs):
            runs.append(one_run(args.nodes, Path(tmp)))
            print(f"run {i + 1}: {runs[-1]}", file=sys.stderr)
    preset = bench_preset(args.nodes)["watchdog"]
    watchdog_bound = preset["dead_probes"] * preset["probe_interval_s"]
    result = {
        "runs": runs,
        "median_submit_to_healthy_s": statistics.median(r["submit_to_healthy_s"] for r in runs),
        "median_death_to_end_s": statistics.median(r["death_to_end_s"] for r in runs),
        "watchdog_only_bound_s": watchdog_bound,
    }
    result["death_to_end_vs_watchdog_bound"] = result["median_death_to_end_s"] / watchdog_bound
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"nodes: {args.nodes}, runs: {args.runs}")
    print(f"submit -> healthy (median):      {result['median_submit_to_healthy_s']:7.1f} s")
    print(f"trainer death -> job end (median): {result['median_death_to_end_s']:5.1f} s")
    print(
        f"watchdog-only bound ({preset['dead_probes']} x {preset['probe_interval_s']:g} s): "
        f"{watchdog_bound:5.1f} s; ratio {result['death_to_end_vs_watchdog_bound']:.2f}"
    )


if __name__ == "__main__":
    main()
