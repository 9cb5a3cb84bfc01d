"""Elastic hybrid training, the training side: steps/s of the core lane alone vs the core plus hybrid lanes,
measured in the same run, and a lane's join (and leave) latency by phase.

    .venv/bin/python bench/elastic.py [--lanes 1] [--rounds 3] [--steps 4] [--batch 16] [--seq-len 128]
    .venv/bin/python bench/elastic.py --engine [--rounds 3]     # borrow/return a CPU engine: phases
    python3 bench/elastic.py --engine --gpus --hidden 1024 --layers 8 --batch 32 --seq-len 512
                                           # two GPUs: core lane on GPU 0, the engine's GPU 1 borrowed

A training-bound loop (one large forward_backward + optim_step per step, no sampling) on a tiny model,
float32, CPU, gloo. Lanes are HybridLane Ray actors (miles/train/hybrid), the core first; rounds alternate
core alone and core + lanes (lanes leave and rejoin between rounds, so every round also measures a join:
connect, group, state_transfer, and the first step after it). Prints medians and the ratio.
On CPU the lanes share the machine's cores: the ratio says what a lane costs or gains *here*; on GPUs each
lane has its own device. `--engine`: a CPU engine cell on a logical GPU is lent and given back each round
(LoanExecutor + EngineCellPort + BundleLanePort): drain, free, start, state_transfer; the first step on
the lane; leave, stop_lane, serving (engine restarted and READY); and steps/s of the core alone (the engine
serving) vs the core + the borrowed lane, in the same run. `--gpus`: the two bundles are real GPUs (the core
lane on GPU 0, the engine and then the lane on GPU 1; the engine stays the CPU engine, whose GPU the lane
takes): the two-GPU run of issue 22; `--hidden`/`--layers` size the model so a step is worth a lane.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from miles.models.tiny import TinyModelSpec, build_tiny_model
from miles.train.hybrid.coordinator import HybridTrainer, Lane
from miles.train.hybrid.lane import LANE_CONCURRENCY_GROUPS, HybridLane
from miles.types import AdamParams, Datum

ADAM = AdamParams(learning_rate=1e-3)


def batch(seed: int, size: int, seq_len: int, vocab: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(size):
        tokens = rng.integers(0, vocab, seq_len + 1).astype(np.int64)
        weights = np.ones(seq_len, dtype=np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return data


async def timed_steps(trainer: HybridTrainer, steps: int, args: argparse.Namespace, seed: int) -> list[float]:
    seconds = []
    for step in range(steps):
        data = batch(seed + step, args.batch, args.seq_len, 1024)
        started = time.perf_counter()
        await trainer.forward_backward("full", data, "cross_entropy", {})
        await trainer.optim_step("full", ADAM)
        seconds.append(time.perf_counter() - started)
    return seconds


async def run(args: argparse.Namespace) -> None:
    model = build_tiny_model(Path(tempfile.mkdtemp(prefix="elastic-bench-")))
    remote = ray.remote(num_cpus=1, concurrency_groups=LANE_CONCURRENCY_GROUPS)(HybridLane)
    lanes = [
        Lane(name, remote.remote(name, torch_threads=args.threads))
        for name in ("core", *[f"lane-{i}" for i in range(args.lanes)])
    ]
    await asyncio.gather(*(lane.actor.setup.remote("bench", str(model), "full") for lane in lanes))
    trainer = HybridTrainer("bench", lanes[0], check_every=0)
    await trainer.start()
    await timed_steps(trainer, 1, args, 10_000)  # warm-up: first-call costs out of both series
    alone, hybrid, joins, first_steps, leaves = [], [], [], [], []
    for round_index in range(args.rounds):
        alone += await timed_steps(trainer, args.steps, args, 100 * round_index)
        phases: dict[str, float] = {}
        for lane in lanes[1:]:
            await trainer.join(lane)
            for phase, value in trainer.last_join_phases.items():
                phases[phase] = phases.get(phase, 0.0) + value
        joins.append(phases)
        first = await timed_steps(trainer, 1, args, 50 + 100 * round_index)
        first_steps += first
        hybrid += await timed_steps(trainer, args.steps, args, 60 + 100 * round_index)
        started = time.perf_counter()
        for lane in lanes[1:]:
            await trainer.leave(lane.name)
        leaves.append(time.perf_counter() - started)
    med = statistics.median
    print(f"batch {args.batch} x {args.seq_len} tokens, {args.lanes} hybrid lane(s), {os.cpu_count()} CPUs")
    print(f"core alone      : {1 / med(alone):7.2f} steps/s (median of {len(alone)} steps)")
    print(f"core + lanes    : {1 / med(hybrid):7.2f} steps/s (median of {len(hybrid)} steps)")
    print(f"ratio           : {med(alone) / med(hybrid):7.2f}x")
    for phase in joins[0]:
        print(f"join {phase:<15}: {med([j[phase] for j in joins]) * 1e3:7.1f} ms (median of {len(joins)})")
    print(f"first step after: {med(first_steps) * 1e3:7.1f} ms")
    print(f"leave           : {med(leaves) * 1e3:7.1f} ms")


async def run_engine_loans(args: argparse.Namespace) -> None:
    """Borrow and return one CPU engine cell `--rounds` times: each phase's latency (LoanExecutor's)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.cluster.placement import create_gpu_placement_group
    from miles.elastic.engine_port import EngineCellPort
    from miles.elastic.lane_port import BundleLanePort, RemoteLane
    from miles.elastic.ledger import Gpu, GpuLedger
    from miles.elastic.loans import LoanExecutor
    from miles.engines.config import EngineConfig
    from miles.rollout.controller import InferenceController
    from miles.rollout.engine_cell import EngineCell

    model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="elastic-bench-")), model_spec(args)))
    pg = await create_gpu_placement_group(2, cpus_per_bundle=1, timeout_s=120)
    cell = EngineCell(0, EngineConfig(model_path=model, num_cpus=1, startup_timeout_s=300), (pg, 1))
    controller = InferenceController([cell])
    core_place = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    core = Lane(
        "core", RemoteLane.options(num_cpus=1, num_gpus=1, scheduling_strategy=core_place).remote("core")
    )
    await asyncio.gather(controller.start(), core.actor.setup.remote("bench", model, "full"))
    await controller.refresh_weights()
    trainer = HybridTrainer("bench", core, check_every=0)
    await trainer.start()
    ledger = GpuLedger(min_rollout_gpus=0)
    ledger.add_engine("e0", [Gpu("local", 1)])
    lanes = BundleLanePort(pg, {"e0": 1}, run="bench", model_path=model, train_mode="full")
    loans = LoanExecutor(ledger, trainer, lanes, {"e0": EngineCellPort(controller, cell)})
    await timed_steps(trainer, 1, args, 10_000)  # warm-up: first-call costs out of both series
    borrows, returns, firsts, alone, lent_steps = [], [], [], [], []
    for round_index in range(args.rounds):
        alone += await timed_steps(trainer, args.steps, args, 100 * round_index)  # borrowing off
        async with controller.weight_update(base_weights=False):
            lent = await loans.borrow("e0")
        assert lent.ok, lent.reason
        borrows.append(lent.phases)
        firsts += await timed_steps(trainer, 1, args, 1000 + round_index)
        lent_steps += await timed_steps(trainer, args.steps, args, 50 + 100 * round_index)  # borrowing on
        back = await loans.give_back("e0")
        assert back.ok, back.reason
        returns.append(back.phases)
    await controller.stop()
    med = statistics.median
    where = "two GPUs" if args.gpus else f"logical GPUs, {os.cpu_count()} CPUs"
    print(f"engine loans: {args.rounds} rounds, CPU engine, {where}, batch {args.batch} x {args.seq_len}")
    print(f"core alone (engine serving): {1 / med(alone):7.2f} steps/s (median of {len(alone)} steps)")
    print(f"core + borrowed lane       : {1 / med(lent_steps):7.2f} steps/s (median of {len(lent_steps)})")
    print(f"ratio on/off               : {med(alone) / med(lent_steps):7.2f}x")
    for label, rounds in (("borrow", borrows), ("return", returns)):
        for phase in rounds[0]:
            print(f"{label} {phase:<15}: {med([r[phase] for r in rounds]) * 1e3:8.1f} ms")
    print(f"first step on the lane: {med(firsts) * 1e3:8.1f} ms")


def model_spec(args: argparse.Namespace) -> TinyModelSpec:
    heads = max(4, args.hidden // 64)
    return TinyModelSpec(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 2),
        head_dim=args.hidden // heads,
        intermediate_size=2 * args.hidden,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per lane")
    parser.add_argument("--engine", action="store_true", help="borrow and return a CPU engine cell instead")
    parser.add_argument("--gpus", action="store_true", help="--engine on two real GPUs (issue 22's run)")
    parser.add_argument("--hidden", type=int, default=64, help="--engine: the model's hidden size")
    parser.add_argument("--layers", type=int, default=2, help="--engine: the model's layers")
    args = parser.parse_args()
    ray.init(
        num_cpus=max(args.lanes + 1, 3),
        num_gpus=2 if args.engine else 0,  # logical GPUs on CPU (placement only); --gpus: the real two
        include_dashboard=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        asyncio.run(run_engine_loans(args) if args.engine else run(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
