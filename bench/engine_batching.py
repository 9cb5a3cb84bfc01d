"""The CPU engine's step batching against request-by-request decoding, in the same run.

    .venv/bin/python bench/engine_batching.py [--device cpu|cuda] [--shape tiny] [--groups 8] [--samples 8]
                                              [--new-tokens 128] [--prompt-len 32] [--repeats 1] [--threads 2]
                                              [--json out.json]

The load of an RL step: `--groups` prompts x `--samples` seeded samples (seed + i, as the gateway sends a
Tinker sample), all sent at once, each generating exactly `--new-tokens` tokens (ignore_eos). The same
requests go through two engines built from the same model: `--max-running-requests 1` (one sequence per
forward: the old request-by-request engine) and the default cap (one forward per step for every running
sequence). Requests enter through the functions /generate uses (no HTTP, so the numbers are the engine's).
Prints generated tokens/s of each, their ratio and the forwards each ran; `--repeats` alternates the two
and reports the median ratio. No assertion on timings: the numbers are recorded in docs/engines.md.
`--shape` is a `miles.models.tiny` shape (`tiny`; `qwen3-0.6b` where that shape exists) with random weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", default="tiny", help="a miles.models.tiny shape")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def build_model(shape: str, out: Path) -> Path:
    from miles.models.tiny import build_tiny_model

    if shape == "tiny":
        return build_tiny_model(out)
    from miles.models.tiny import tiny_spec  # the named shapes (model.init_shape)

    return build_tiny_model(out, tiny_spec(shape))


def requests(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """One /generate body per sample: groups x samples, seeds seed + i within a group."""
    import torch

    torch.manual_seed(0)
    bodies = []
    for group in range(args.groups):
        prompt = torch.randint(10, min(vocab, 1000), (args.prompt_len,)).tolist()
        for i in range(args.samples):
            params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
            bodies.append(
                {"input_ids": prompt, "sampling_params": {**params, "sampling_seed": 1000 * group + i}}
            )
    return bodies


async def run_all(engine: Any, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """Wall seconds and generated tokens of all `bodies` sent at once."""
    from miles.engines.cpu.server import build_jobs, run_to_end

    jobs = [job for body in bodies for job in build_jobs(body, engine)[0]]
    start = time.perf_counter()
    answers = await asyncio.gather(*(run_to_end(engine, job) for job in jobs))
    seconds = time.perf_counter() - start
    return seconds, sum(len(a["output_ids"]) for a in answers)


async def measure(engine: Any, bodies: list[dict[str, Any]]) -> dict[str, float]:
    before = engine.scheduler.snapshot()
    seconds, tokens = await run_all(engine, bodies)
    after = engine.scheduler.snapshot()
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "forwards": after["forward_steps"] - before["forward_steps"],
        "max_batch_size": after["max_batch_size"],
    }


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from miles.engines.cpu.engine import Engine

    engines = {
        "one_at_a_time": Engine(str(model_dir), max_running_requests=1),
        "batched": Engine(str(model_dir)),
    }
    for engine in engines.values():
        await engine.load()
        if engine.runner is None:
            raise SystemExit(f"the model failed to load: {engine.load_error}")
    vocab = engines["batched"].model().model.config.vocab_size
    bodies = requests(args, vocab)
    warm = [{**bodies[0], "sampling_params": {**bodies[0]["sampling_params"], "max_new_tokens": 4}}] * 4
    for engine in engines.values():  # first forwards allocate and pick kernels: outside the clock
        await run_all(engine, warm)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(await measure(engine, bodies))
            print(f"{name:>14}: {runs[name][-1]}", flush=True)
    for engine in engines.values():
        await engine.close()
    ratios = [b["tokens_per_s"] / s["tokens_per_s"] for s, b in zip(*runs.values(), strict=True)]
    return {
        "args": vars(args),
        "device": str(engines["batched"].model().device),
        "runs": runs,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch loads: the engine then picks the CPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    torch.set_num_threads(max(args.threads, 1))
    with tempfile.TemporaryDirectory(prefix="engine-batching-") as tmp:
        result = asyncio.run(bench(args, build_model(args.shape, Path(tmp) / "model")))
    n = args.groups * args.samples
    for name, runs in result["runs"].items():
        rate = statistics.median(r["tokens_per_s"] for r in runs)
        load = f"{n} requests x {args.new_tokens} tokens, {result['device']}"
        print(f"{name:>14}: {rate:10.1f} tokens/s  ({load})")
    print(f"{'ratio':>14}: {statistics.median(result['ratios']):10.2f}x  (batched / one at a time, median)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
