"""Catalog instances: the cold start of a dynamic instance against the first operation on a resident one,
and release -> GPUs free again, measured side by side in one run.

    .venv/bin/python bench/catalog.py [--rounds 3] [--json]

A local Ray with 4 logical GPUs; the catalog is the tiny model under two names, each instance 2 GPUs
(trainer cell + one CPU engine): `tiny-resident` (started before timing, as at bring-up) and
`tiny-dynamic` (started on demand). Per round, through the CatalogRuntime router the gateway uses:

- resident: create_model + the first forward_backward of a new tenant on the running resident instance;
- cold: create_model + the first forward_backward on the dynamic model, whose instance starts for it
  (placement group, trainer and engine cells, first weights);
- release: the dynamic tenant's release_model until Ray reports its 2 GPUs free again (the backend's
  stop waits for that), and, for comparison, the resident tenant's release (a slot reset, no stop).

Prints medians and the ratios cold/resident and release/resident-reset. On CPU the cold start is mostly
process start-up (a Ray worker importing torch for the trainer, the engine process loading the model);
on GPU nodes add CUDA context creation and real weight loading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.tiny_catalog import build_router, tiny_catalog_model  # noqa: E402
from miles.models.tiny import build_tiny_model  # noqa: E402
from miles.seam.requests import ForwardBackwardRequest  # noqa: E402
from miles.types import Datum, LoraSpec  # noqa: E402

RESIDENT, DYNAMIC = "tiny-resident", "tiny-dynamic"
ROWS = [[5, 17, 300, 42, 9, 77, 512, 3], [40, 41, 42, 43, 44, 45]]


def batch() -> list[Datum]:
    return [
        Datum(np.asarray(r[:-1]), {"target_tokens": np.asarray(r[1:]), "weights": np.ones(len(r) - 1)})
        for r in ROWS
    ]


async def first_operation(router, model_id: str, base: str) -> float:
    started = time.perf_counter()
    await router.create_model(model_id, base, LoraSpec(rank=4, seed=1))
    await router.forward_backward(ForwardBackwardRequest(model_id, batch(), "cross_entropy", {}))
    return time.perf_counter() - started


async def release(router, model_id: str, gpus_free: float | None) -> float:
    started = time.perf_counter()
    await router.release_model(model_id)
    while gpus_free is not None and ray.available_resources().get("GPU", 0.0) < gpus_free:
        await asyncio.sleep(0.01)
    return time.perf_counter() - started


async def run(rounds: int) -> dict[str, list[float]]:
    workdir = Path(tempfile.mkdtemp(prefix="catalog-bench-"))
    model_dir = build_tiny_model(workdir / "model")
    ray.init(  # GPUs are logical: they place the cells, which run on CPU
        num_cpus=8,
        num_gpus=4,
        include_dashboard=False,
        _temp_dir=str(workdir / "ray"),
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    models = [tiny_catalog_model(RESIDENT, "lora", resident=True), tiny_catalog_model(DYNAMIC, "lora")]
    router = build_router(models, model_dir, workdir / "logs")
    await router.start()  # the resident instance is up before anything is timed, as after bring-up
    times: dict[str, list[float]] = {"resident": [], "cold": [], "release": [], "resident_reset": []}
    try:
        for i in range(rounds):
            times["resident"].append(await first_operation(router, f"res-{i}", RESIDENT))
            times["cold"].append(await first_operation(router, f"dyn-{i}", DYNAMIC))
            times["release"].append(await release(router, f"dyn-{i}", gpus_free=2.0))
            times["resident_reset"].append(await release(router, f"res-{i}", gpus_free=None))
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    finally:
        await router.close()
        ray.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    times = asyncio.run(run(args.rounds))
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "cold_over_resident": medians["cold"] / medians["resident"],
        "release_over_resident_reset": medians["release"] / medians["resident_reset"],
    }
    if args.json:
        print(json.dumps({"rounds": args.rounds, "seconds": times, "median_s": medians, "ratios": ratios}))
        return
    print(f"resident instance, create + first forward_backward: {medians['resident']:.2f} s (median)")
    print(f"dynamic instance cold start, create + first forward_backward: {medians['cold']:.2f} s")
    print(f"dynamic release until its GPUs are free: {medians['release']:.2f} s")
    print(f"resident tenant release (slot reset): {medians['resident_reset']:.2f} s")
    print(f"cold start / resident first op: {ratios['cold_over_resident']:.1f}x")
    print(f"release to free GPUs / resident reset: {ratios['release_over_resident_reset']:.1f}x")


if __name__ == "__main__":
    main()
