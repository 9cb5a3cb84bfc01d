"""Full-weight push throughput vs a raw torch.distributed broadcast of the same bytes, in the same run.

    .venv/bin/python bench/push.py [--model-mib 1024] [--sweep 64,128,512] [--repeats 3] [--json out.json]
                                   [--fresh-group]

Push: a real trainer cell (full fine-tuning) pushes to 2 CPU engine cells through the InferenceController
bracket (pause, flush, begin, group join, per-bucket POSTs || broadcast, version, end, continue).
Baseline: 1 sender + 2 receiver processes in a gloo group (the same weight_group helper) broadcasting the
same bucket sizes into buffers allocated once, then each receiver acks, so both clocks stop when both
receivers hold every byte.
For each bucket size, after one warm-up push, `--repeats` pairs of a raw run and a push run back to back
(the load of a shared machine drifts): bytes/s of each, the median of the pairs' ratios (push / raw)
with their spread, and where the median pair's push spent its time (PushReport.breakdown). The raw group
is set up outside its clock; a push reuses the group the warm-up push kept (the production default),
or, with `--fresh-group`, makes and destroys one inside its clock. Numbers are recorded in docs/weights.md.

    .venv/bin/python bench/push.py --delta [--model-mib 1024] [--lrs 1e-5,1e-6] [--repeats 3] [--json out]

`--delta` (issue 36, docs/weights.md "Delta push"): the model in bf16 (trainer and engines), one bucket
size (`--sweep`'s first). Per lr and repeat: one real AdamW step (forward_backward + optim_step at that lr)
on a random batch, then, back to back, the delta push (against the image the last push left), the full
push of the same weights (`PushConfig.delta` off), and a raw broadcast of the same bucket sizes; then an
untimed recording push so the next repeat's delta push has an image again. Reported: bytes sent, seconds,
full / delta and full / raw (medians over repeats, with the spread), and that every delta push's engines
matched the trainer's image tensor by tensor (the digest the push checks anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from delta_report import delta_line, delta_row, delta_summary, print_summary, timed_pair

from miles.engines.weight_group import create_weight_update_group, pick_master_port
from miles.utils.buckets import TensorMeta, plan_buckets

RECEIVERS = 2


def _receiver(rank: int, port: int, sizes: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=1 + RECEIVERS,
        backend="gloo", group_name="bench", timeout_s=120,
    )  # fmt: skip
    # Buffers made and touched once, outside the clock: the transport at its best (a fresh buffer per
    # broadcast would charge the baseline with page faults that the push's in-place receive does not pay).
    buffers = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    for _ in range(repeats):
        for buffer in buffers:
            group.broadcast(buffer, src=0)
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


@contextlib.asynccontextmanager
async def cells(model_dir: Path, bf16: bool = False):
    """(controller, trainer): Ray on this machine, 2 CPU engine cells and a full fine-tuning trainer
    cell (bf16 on both sides with `bf16`, else the model's own dtype), stopped on the way out."""
    import ray

    from miles.cluster.placement import create_gpu_placement_group
    from miles.engines.config import EngineConfig
    from miles.rollout.controller import InferenceController
    from miles.rollout.engine_cell import EngineCell
    from miles.train.cell import TrainerCell

    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ray-bench-"))
    pg = await create_gpu_placement_group(3, cpus_per_bundle=1, timeout_s=120)
    extra = ("--dtype", "bfloat16") if bf16 else ()
    engines = EngineConfig(model_path=str(model_dir), num_cpus=1, startup_timeout_s=600, extra_args=extra)
    controller = InferenceController([EngineCell(i, engines, (pg, 1 + i)) for i in range(RECEIVERS)])
    trainer = TrainerCell(0)
    dtype = {"dtype": torch.bfloat16} if bf16 else {}
    try:
        await asyncio.gather(
            controller.start(),
            trainer.start([(pg, 0)], model_path=str(model_dir), train_mode="full", **dtype),
        )
        yield controller, trainer
    finally:
        await controller.stop()
        await trainer.stop()
        ray.shutdown()


async def paired_runs(
    model_dir: Path, plans: dict[int, list[int]], repeats: int, keep_group: bool = True
) -> dict[int, list]:
    """{bucket bytes: [(raw seconds, push seconds, PushReport)] x repeats}. Per bucket size one warm-up
    push, then pairs: a raw broadcast of the same bucket sizes, then a push, back to back, so both see
    the same load on the machine (a shared 2-core machine drifts by 2x within a minute)."""
    from miles.weights.push import PushConfig, push_full_weights

    results: dict[int, list] = {}
    async with cells(model_dir) as (controller, trainer):
        for bucket_bytes, sizes in plans.items():
            config = PushConfig(bucket_bytes=bucket_bytes, keep_group=keep_group)
            await push_full_weights(controller, trainer, config)  # warm-up: imports, first connections
            pairs = []
            for _ in range(repeats):
                raw = await asyncio.to_thread(raw_broadcast_seconds, sizes, 2)
                start = time.perf_counter()
                report = await push_full_weights(controller, trainer, config)
                pairs.append((raw[-1], time.perf_counter() - start, report))  # raw's second, warm pass
            results[bucket_bytes] = pairs
    return results


async def _train_step(trainer, lr: float, seed: int) -> None:
    """One real step: cross-entropy on a random 2 x 32-token batch, then AdamW at `lr`."""
    import numpy as np

    from miles.train.commands import ForwardBackward, OptimStep
    from miles.types import AdamParams, Datum

    tokens = np.random.default_rng(seed).integers(1, 4000, size=33)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(32, dtype=np.float32)})
    await trainer.run(ForwardBackward("full", [datum, datum], "cross_entropy", {}))
    await trainer.run(OptimStep("full", AdamParams(learning_rate=lr)))


async def delta_runs(model_dir: Path, bucket_bytes: int, sizes: list[int], lrs: list[float], repeats: int):
    """{lr: [row per repeat]}: a step at lr, then the delta push, the full push and a raw broadcast."""
    from miles.weights.push import PushConfig, push_full_weights

    full = PushConfig(bucket_bytes=bucket_bytes)
    deltas = PushConfig(bucket_bytes=bucket_bytes, delta=True, delta_pace=False)

    results: dict[float, list[dict]] = {}
    # the engines hold what the trainer sends (bf16; a CPU engine's auto is float32)
    async with cells(model_dir, bf16=True) as (controller, trainer):

        def push(config: PushConfig):
            return push_full_weights(controller, trainer, config)

        await push_full_weights(controller, trainer, full)  # warm-up: imports, first connections
        for lr in lrs:
            results[lr] = []
            for repeat in range(repeats):
                await push_full_weights(controller, trainer, deltas)  # records the image, untimed
                await _train_step(trainer, lr, seed=repeat)
                sent, delta_s, whole, full_s = await timed_pair(push, deltas, full)
                raw_s = (await asyncio.to_thread(raw_broadcast_seconds, sizes, 2))[-1]
                results[lr].append(delta_row(sent, delta_s, whole, full_s, raw_s))
                print(delta_line(lr, results[lr][-1]))
    return results


def model_spec(model_mib: float, dtype: str = "float32"):
    """A Qwen3-shaped random model of about `model_mib` MiB of weights in `dtype` (hidden 1024)."""
    from miles.models.tiny import TinyModelSpec

    hidden, inter, vocab = 1024, 3072, 4096
    itemsize = 2 if dtype == "bfloat16" else 4
    per_layer = itemsize * (2 * hidden * hidden + 2 * hidden * hidden // 2 + 3 * hidden * inter)
    layers = max(1, round((model_mib * 2**20 - itemsize * 2 * vocab * hidden) / per_layer))
    return TinyModelSpec(
        dtype=dtype,  # type: ignore[arg-type]
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        intermediate_size=inter,
        vocab_size=vocab,
    )


def _median_index(times: list[float]) -> int:
    return sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mib", type=float, default=1024, help="fp32 weights of the random model")
    parser.add_argument("--sweep", default="64,128,512", help="bucket sizes, MiB (512: production default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--fresh-group", action="store_true", help="a group per push (keep_group=False)")
    parser.add_argument(
        "--delta", action="store_true", help="bf16 model: delta push vs full push after a step"
    )
    parser.add_argument("--lrs", default="1e-5,1e-6", help="--delta: the learning rates of the steps")
    args = parser.parse_args()
    if args.delta:
        return delta_main(args)

    from safetensors import safe_open

    from miles.models.tiny import build_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="bench-push-model-"))
    build_tiny_model(model_dir, model_spec(args.model_mib))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        metas = [TensorMeta.of(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
    bucket_sizes = [int(float(mib) * 2**20) for mib in args.sweep.split(",")]
    total = sum(m.nbytes for m in metas)
    mib = 2**20
    print(f"model: {len(metas)} tensors, {total / mib:.1f} MiB fp32; receivers: {RECEIVERS}; x{args.repeats}")

    plans = {size: _sizes(metas, size) for size in bucket_sizes}
    runs = asyncio.run(paired_runs(model_dir, plans, args.repeats, keep_group=not args.fresh_group))
    rows = []
    for size in bucket_sizes:
        pairs = runs[size]
        ratios = sorted(raw / push for raw, push, _ in pairs)
        median_pair = sorted(pairs, key=lambda pair: pair[0] / pair[1])[len(pairs) // 2]
        raw_s, push_s, report = median_pair
        if report.bytes != total:
            raise SystemExit(f"push moved {report.bytes} bytes, the model has {total}: an unfair comparison")
        row = {
            "bucket_mib": size / mib,
            "buckets": report.buckets,
            "raw_s": raw_s,
            "push_s": push_s,
            "ratio": statistics.median(ratios),
            "ratio_spread": [ratios[0], ratios[-1]],
            # a tree before PushReport.breakdown (to measure "before") has the three phases only
            "breakdown": report.breakdown() if hasattr(report, "breakdown") else report.seconds,
        }
        rows.append(row)
        print(
            f"bucket {size / mib:5.0f} MiB x{report.buckets:3d}: "
            f"raw {raw_s:.3f} s {total / raw_s / mib:7.1f} MiB/s | "
            f"push {push_s:.3f} s {total / push_s / mib:7.1f} MiB/s | "
            f"ratio {row['ratio']:.2f} (pairs: {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )
        print("    median pair's push: " + ", ".join(f"{k} {v:.3f}" for k, v in row["breakdown"].items()))
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": total, "rows": rows}, indent=2))


def delta_main(args: argparse.Namespace) -> None:
    from safetensors import safe_open

    from miles.models.tiny import build_tiny_model

    model_dir = Path(tempfile.mkdtemp(prefix="bench-push-delta-"))
    build_tiny_model(model_dir, model_spec(args.model_mib, "bfloat16"))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        metas = [TensorMeta.of(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
    bucket_bytes = int(float(args.sweep.split(",")[0]) * 2**20)
    lrs = [float(x) for x in args.lrs.split(",")]
    total = sum(m.nbytes for m in metas)
    print(
        f"model: {len(metas)} tensors, {total / 2**20:.1f} MiB bf16; receivers: {RECEIVERS}; x{args.repeats}"
    )
    runs = asyncio.run(delta_runs(model_dir, bucket_bytes, _sizes(metas, bucket_bytes), lrs, args.repeats))
    summary = delta_summary(runs)
    print_summary(summary)
    if args.json:
        payload = {"model_bytes": total, "bucket_bytes": bucket_bytes, "receivers": RECEIVERS, "lrs": summary}
        args.json.write_text(json.dumps(payload, indent=2))


def _sizes(metas: list[TensorMeta], bucket_bytes: int) -> list[int]:
    return [sum(m.nbytes for m in b) for b in plan_buckets(metas, bucket_bytes, flattened=True)]


if __name__ == "__main__":
    main()
