"""Where a decode step of the CPU engine goes, against HF `generate`, on one batch (same run, same model).

    python bench/engine_decode_profile.py [--device cuda] [--shape qwen3-0.6b] [--rows 64] [--prompt-len 64]
                                          [--new-tokens 128] [--json out.json]

The RL loop's sampling load (bench/rl_loop.py: 64 unseeded samples, exactly 128 new tokens) four ways,
each timed per decode step after a short warm-up, in two rounds (`#1`, `#2`): a thread's first long pass
over new KV lengths builds an attention plan per length (cuDNN) and runs ~2.7x slower, so compare `#2`:

- `engine`: the whole engine path (Engine + its step scheduler, requests as /generate builds them);
- `steps`: the engine's step function alone (miles.engines.cpu.step.run_group_step) in a loop, no
  scheduler, no requests: what the model thread does;
- `forward`: the engine's batched forward alone (ModelRunner.forward_batch on the left-padded cache), no
  sampling: the model's share;
- `generate`: HF `model.generate` on the same left-padded batch (sampling at temperature 1).

Then the step split into its parts with a sync after each (`split:` the forward and the sampling called
directly, `traced:` inside the step function), torch.profiler's top operators by self CPU time over a few
`steps` (the host-side overhead when the GPU waits for the CPU to launch kernels) and, on CUDA, the top
GPU kernels. No assertion: the numbers go to docs (docs/colocation.md, "Measured").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_batching import build_model  # the sibling bench: the same model builder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import torch

    torch.manual_seed(0)
    return [torch.randint(10, min(vocab, 1000), (args.prompt_len,)).tolist() for _ in range(args.rows)]


async def engine_path(engine: Any, seqs: list[list[int]], new_tokens: int) -> float:
    from miles.engines.cpu.server import build_jobs, run_to_end

    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    bodies = [{"input_ids": s, "sampling_params": params, "return_logprob": True} for s in seqs]
    jobs = [job for body in bodies for job in build_jobs(body, engine)[0]]
    started = time.perf_counter()
    await asyncio.gather(*(run_to_end(engine, job) for job in jobs))
    return time.perf_counter() - started


def steps_path(runner: Any, seqs: list[list[int]], new_tokens: int, decode_forward_only: bool) -> float:
    """Prefill once, then `new_tokens` decode steps: the step function, or only the batched forward."""
    import torch

    from miles.engines.cpu import kvbatch
    from miles.engines.cpu.sampling import parse_sampling_params
    from miles.engines.cpu.step import GroupPlan, RowPlan, StepStats, run_group_step

    cfg = parse_sampling_params({"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
    stats = StepStats()
    with torch.inference_mode():
        plan = GroupPlan(None, None, [], [], [RowPlan(cfg, None, tokens=s) for s in seqs])
        kv, results = run_group_step(runner, plan, None, stats)
        tokens = [r.token for r in results]
        sync(runner.device)
        started = time.perf_counter()
        for _ in range(new_tokens):
            if decode_forward_only:
                ids, mask, positions = kvbatch.step_inputs(kv, tokens)
                _, kv.cache = runner.forward_batch(ids, mask, positions, kv.cache, None)
                kv.mask, kv.next_pos = mask, kv.next_pos + 1
            else:
                rows = [RowPlan(cfg, None, tokens=[t]) for t in tokens]
                plan = GroupPlan(None, kv, list(range(len(tokens))), rows, [])
                kv, results = run_group_step(runner, plan, None, stats)
                tokens = [r.token for r in results]
        sync(runner.device)
        return time.perf_counter() - started


def split_path(runner: Any, seqs: list[list[int]], new_tokens: int) -> dict[str, float]:
    """The decode loop with a sync after the forward and after the sampling: seconds of each part."""
    import torch

    from miles.engines.cpu import kvbatch
    from miles.engines.cpu.sampling import choose_tokens, parse_sampling_params
    from miles.engines.cpu.step import GroupPlan, RowPlan, StepStats, run_group_step

    cfg = parse_sampling_params({"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
    parts = {"inputs": 0.0, "forward": 0.0, "sample": 0.0}
    with torch.inference_mode():
        plan = GroupPlan(None, None, [], [], [RowPlan(cfg, None, tokens=s) for s in seqs])
        kv, results = run_group_step(runner, plan, None, StepStats())
        tokens = [r.token for r in results]
        for _ in range(new_tokens):
            sync(runner.device)
            t0 = time.perf_counter()
            ids, mask, positions = kvbatch.step_inputs(kv, tokens)
            sync(runner.device)
            t1 = time.perf_counter()
            logits, kv.cache = runner.forward_batch(ids, mask, positions, kv.cache, None)
            kv.mask, kv.next_pos = mask, kv.next_pos + 1
            sync(runner.device)
            t2 = time.perf_counter()
            tokens, _ = choose_tokens(logits[:, -1], [cfg] * len(tokens), [None] * len(tokens), None)
            t3 = time.perf_counter()
            parts["inputs"] += t1 - t0
            parts["forward"] += t2 - t1
            parts["sample"] += t3 - t2
    return parts


def traced_steps(runner: Any, seqs: list[list[int]], new_tokens: int) -> dict[str, float]:
    """`steps` with each part of the step function timed (a sync after each): where its time goes."""
    from miles.engines.cpu import kvbatch, step

    parts: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sync(runner.device)
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(runner.device)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - started
            return out

        return wrapper

    originals = (kvbatch.select, kvbatch.step_inputs, step._sample, runner.forward_batch)
    step.kvbatch.select = timed("select", kvbatch.select)
    step.kvbatch.step_inputs = timed("step_inputs", kvbatch.step_inputs)
    step._sample = timed("sample", step._sample)
    runner.forward_batch = timed("forward", runner.forward_batch)
    try:
        total = steps_path(runner, seqs, new_tokens, decode_forward_only=False)
    finally:
        kvbatch.select, kvbatch.step_inputs, step._sample = originals[:3]
        step.kvbatch.select, step.kvbatch.step_inputs = originals[:2]
        del runner.forward_batch  # the instance attribute: the method is back
    parts["total"] = total
    return parts


def cuda_kernels(runner: Any, seqs: list[list[int]], steps: int) -> list[dict[str, Any]]:
    """The top GPU kernels by device time over `steps` engine steps (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps_path(runner, seqs, steps, decode_forward_only=False)
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    return [
        {
            "op": e.key,
            "calls": e.count,
            "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / steps,
        }
        for e in events[:15]
    ]


def generate_path(runner: Any, seqs: list[list[int]], new_tokens: int) -> float:
    import torch

    from miles.engines.cpu import kvbatch

    ids, mask, _ = kvbatch.left_padded(seqs, runner.device)
    with torch.inference_mode():
        sync(runner.device)
        started = time.perf_counter()
        runner.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        sync(runner.device)
        return time.perf_counter() - started


def profile_steps(runner: Any, seqs: list[list[int]], steps: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        steps_path(runner, seqs, steps, decode_forward_only=False)
    table = []
    for event in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:20]:
        table.append(
            {
                "op": event.key,
                "calls": event.count,
                "self_cpu_ms_per_step": event.self_cpu_time_total / 1e3 / steps,
            }
        )
    return table


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from miles.engines.cpu.engine import Engine

    engine = Engine(str(model_dir))
    await engine.load()
    if engine.runner is None:
        raise SystemExit(f"the model failed to load: {engine.load_error}")
    runner = engine.runner
    seqs = prompts(args, runner.model.config.vocab_size)
    n = args.new_tokens
    # warm-up: kernels picked, allocator grown, for every path
    await engine_path(engine, seqs, 4)
    steps_path(runner, seqs, 4, decode_forward_only=False)
    generate_path(runner, seqs, 4)
    # generate first and every path twice: the first long run of a path grows the allocator's blocks
    seconds: dict[str, float] = {}
    for round_ in (1, 2):
        seconds[f"generate#{round_}"] = await asyncio.to_thread(generate_path, runner, seqs, n)
        seconds[f"forward#{round_}"] = await asyncio.to_thread(steps_path, runner, seqs, n, True)
        seconds[f"steps#{round_}"] = await asyncio.to_thread(steps_path, runner, seqs, n, False)
        seconds[f"engine#{round_}"] = await engine_path(engine, seqs, n)
    seconds["generate"] = seconds["generate#2"]
    per_step_ms = {name: 1e3 * s / n for name, s in seconds.items()}
    split = await asyncio.to_thread(split_path, runner, seqs, n)
    per_step_ms |= {f"split:{name}": 1e3 * s / n for name, s in split.items()}
    traced = await asyncio.to_thread(traced_steps, runner, seqs, n)
    per_step_ms |= {f"traced:{name}": 1e3 * s / n for name, s in traced.items()}
    top = await asyncio.to_thread(profile_steps, runner, seqs, args.profile_steps)
    kernels = []
    if runner.device.type == "cuda":
        kernels = await asyncio.to_thread(cuda_kernels, runner, seqs, args.profile_steps)
    await engine.close()
    return {
        "args": vars(args),
        "device": str(runner.device),
        "per_step_ms": per_step_ms,
        "profile": top,
        "kernels": kernels,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="engine-decode-") as tmp:
        result = asyncio.run(bench(args, build_model(args.shape, Path(tmp) / "model")))
    print(f"{args.rows} rows x {args.new_tokens} new tokens, {result['device']}, ms per decode step:")
    for name, ms in result["per_step_ms"].items():
        ratio = ms / result["per_step_ms"]["generate"]
        print(f"  {name:>9}: {ms:8.2f} ms  ({ratio:.2f}x generate)")
    print("top operators by self CPU time (ms per step of `steps`):")
    for row in result["profile"]:
        print(f"  {row['self_cpu_ms_per_step']:8.3f}  {row['calls']:6d}  {row['op']}")
    if result["kernels"]:
        print("top GPU kernels by device time (ms per step of `steps`):")
        for row in result["kernels"]:
            print(f"  {row['device_ms_per_step']:8.3f}  {row['calls']:6d}  {row['op'][:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
