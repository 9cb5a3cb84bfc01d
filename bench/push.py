"""Full-weight push throughput vs a raw torch.distributed broadcast of the same bytes, in the same run.

    .venv/bin/python bench/push.py [--hidden 384] [--layers 6] [--bucket-mib 16] [--repeats 3]

Push: a real trainer cell (full fine-tuning) pushes to 2 CPU engine cells through the InferenceController
bracket (pause, flush, begin, group join, per-bucket POSTs || broadcast, version, end, continue).
Baseline: 1 sender + 2 receiver processes in a gloo group (the same weight_group helper) broadcasting the
same bucket sizes, then each receiver acks, so both clocks stop when both receivers hold every byte.
Prints bytes/s of each and their ratio (push / raw). Numbers are recorded in docs/weights.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from miles.engines.weight_group import create_weight_update_group, pick_master_port
from miles.weights.buckets import TensorMeta, plan_buckets

RECEIVERS = 2


def _receiver(rank: int, port: int, sizes: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=1 + RECEIVERS,
        backend="gloo", group_name="bench", timeout_s=120,
    )  # fmt: skip
    for _ in range(repeats):
        for size in sizes:
            group.broadcast(torch.empty(size, dtype=torch.uint8), src=0)
        for src in range(1, 1 + RECEIVERS):
            group.broadcast(torch.zeros(1), src=src)
    group.destroy()


def raw_broadcast_seconds(sizes: list[int], repeats: int) -> list[float]:
    port = pick_master_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver, args=(r, port, sizes, repeats)) for r in range(1, 1 + RECEIVERS)]
    for proc in procs:
        proc.start()
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=0, world_size=1 + RECEIVERS,
        backend="gloo", group_name="bench", timeout_s=120,
    )  # fmt: skip
    buffers = [torch.randint(0, 255, (size,), dtype=torch.uint8) for size in sizes]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for buffer in buffers:
            group.broadcast(buffer, src=0)
        for src in range(1, 1 + RECEIVERS):
            group.broadcast(torch.zeros(1), src=src)
        times.append(time.perf_counter() - start)
    group.destroy()
    for proc in procs:
        proc.join(60)
    return times


async def push_seconds(model_dir: Path, bucket_bytes: int, repeats: int) -> tuple[list[float], Any]:
    import ray

    from miles.cluster.placement import create_gpu_placement_group
    from miles.engines.config import EngineConfig
    from miles.rollout.controller import InferenceController
    from miles.rollout.engine_cell import EngineCell
    from miles.train.cell import TrainerCell
    from miles.weights.push import PushConfig, push_full_weights

    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-bench-"))
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    engines = EngineConfig(model_path=str(model_dir), num_cpus=1, startup_timeout_s=300)
    controller = InferenceController([EngineCell(i, engines, (pg, 1 + i)) for i in range(RECEIVERS)])
    trainer = TrainerCell(0)
    await asyncio.gather(
        controller.start(), trainer.start([(pg, 0)], model_path=str(model_dir), train_mode="full")
    )
    config = PushConfig(bucket_bytes=bucket_bytes)
    try:
        await push_full_weights(controller, trainer, config)  # warm-up: imports, first connections
        times, reports = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            reports.append(await push_full_weights(controller, trainer, config))
            times.append(time.perf_counter() - start)
        return times, reports[times.index(statistics.median(times))] if repeats % 2 else reports[-1]
    finally:
        await controller.stop()
        await trainer.stop()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--bucket-mib", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from miles.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        intermediate_size=args.hidden * 3,
    )
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-push-model-")), spec)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        metas = [TensorMeta.of(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
    bucket_bytes = int(args.bucket_mib * 2**20)
    buckets = plan_buckets(metas, bucket_bytes, flattened=True)
    sizes = [sum(m.nbytes for m in b) for b in buckets]
    total = sum(sizes)

    raw = raw_broadcast_seconds(sizes, args.repeats)
    push, report = asyncio.run(push_seconds(model_dir, bucket_bytes, args.repeats))
    if report.bytes != total:
        raise SystemExit(f"push moved {report.bytes} bytes, the model has {total}: the comparison is unfair")
    raw_rate = total / statistics.median(raw)
    push_rate = total / statistics.median(push)
    mib = 2**20
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {len(metas)} tensors, {total / mib:.1f} MiB fp32"
    )
    print(f"buckets: {len(buckets)} of <= {args.bucket_mib:g} MiB; receivers: {RECEIVERS}, x{args.repeats}")
    print(f"raw gloo broadcast : median {statistics.median(raw):.3f} s  {raw_rate / mib:8.1f} MiB/s")
    print(f"full push (2 CPU engines): median {statistics.median(push):.3f} s  {push_rate / mib:8.1f} MiB/s")
    print(f"ratio push / raw   : {push_rate / raw_rate:.2f}")
    phases = ", ".join(f"{name} {secs:.3f} s" for name, secs in report.seconds.items())
    print(f"median push phases : {phases}")


if __name__ == "__main__":
    main()
