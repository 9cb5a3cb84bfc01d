"""The CPU engine's decode paths against HF `generate`, on one batch (same run, same model).

    python bench/engine_decode.py [--device cuda] [--shape qwen3-0.6b] [--rows 64] [--prompt-len 64]
                                  [--new-tokens 128] [--json out.json]

The RL loop's sampling load (bench/rl_loop.py: 64 unseeded samples, exactly 128 new tokens), timed per
decode step after a short warm-up, in two rounds (`#1`, `#2`; compare `#2`: a thread's first pass over new
shapes builds cuDNN attention plans and grows the allocator), each of the engine's decode paths
(miles/engines/cpu/graphs.py) two ways:

- `steps`: the engine's step function (miles.engines.cpu.step.run_group_step) in a loop, no scheduler, no
  requests: what the model thread does;
- `engine`: the whole engine path (Engine + its step scheduler, requests as /generate builds them);

for `dynamic` (the cache grown a column a step), `slots` (fixed slots, eager) and, on CUDA, `graphs` (the
slots' step replayed as a CUDA graph; the engine's default there). The baseline is `generate`: HF
`model.generate` on the same left-padded batch (sampling at temperature 1). Before the timings every path
decodes the same batch greedily and the tokens are compared with `dynamic`'s (`agree`, the fraction of
equal tokens: bf16 rounding may flip a near tie). No assertion: the numbers go to docs
(docs/colocation.md, "Measured").
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


def steps_path(
    runner: Any, seqs: list[list[int]], new_tokens: int, temperature: float = 1.0
) -> tuple[float, list[list[int]]]:
    """Prefill once, then `new_tokens` decode steps of the step function: seconds, and each row's tokens."""
    import torch

    from miles.engines.cpu.sampling import parse_sampling_params
    from miles.engines.cpu.step import GroupPlan, RowPlan, StepStats, run_group_step

    raw = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
    cfg = parse_sampling_params(raw)
    stats = StepStats()
    with torch.inference_mode():
        prefill = [RowPlan(cfg, None, tokens=s) for s in seqs]
        kv, results = run_group_step(runner, GroupPlan(None, None, [], [], prefill, new_tokens), None, stats)
        tokens = [[r.token] for r in results]
        sync(runner.device)
        started = time.perf_counter()
        for left in range(new_tokens - 1, 0, -1):
            rows = [RowPlan(cfg, None, tokens=[t[-1]]) for t in tokens]
            plan = GroupPlan(None, kv, list(range(len(tokens))), rows, [], left)
            kv, results = run_group_step(runner, plan, None, stats)
            for row, result in zip(tokens, results, strict=True):
                row.append(result.token)
        sync(runner.device)
        return time.perf_counter() - started, tokens


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


async def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from miles.engines.cpu.engine import Engine

    engine = Engine(str(model_dir))
    await engine.load()
    if engine.runner is None:
        raise SystemExit(f"the model failed to load: {engine.load_error}")
    runner = engine.runner
    modes = ["dynamic", "slots"] + (["graphs"] if runner.decode_mode == "graphs" else [])
    seqs = prompts(args, runner.model.config.vocab_size)
    n = args.new_tokens
    agree: dict[str, float] = {}
    greedy: dict[str, list[list[int]]] = {}
    for mode in modes:  # warm-up, and every path's greedy tokens against dynamic's
        runner.decode_mode = mode
        await engine_path(engine, seqs, 4)
        greedy[mode] = (await asyncio.to_thread(steps_path, runner, seqs, n, 0.0))[1]
        rows = zip(greedy["dynamic"], greedy[mode], strict=True)
        pairs = [(a, b) for x, y in rows for a, b in zip(x, y, strict=True)]
        agree[mode] = sum(a == b for a, b in pairs) / len(pairs)
    generate_path(runner, seqs, 4)
    seconds: dict[str, float] = {}
    for round_ in (1, 2):
        seconds[f"generate#{round_}"] = await asyncio.to_thread(generate_path, runner, seqs, n)
        for mode in modes:
            runner.decode_mode = mode
            seconds[f"{mode}:steps#{round_}"] = (await asyncio.to_thread(steps_path, runner, seqs, n))[0]
            seconds[f"{mode}:engine#{round_}"] = await engine_path(engine, seqs, n)
    await engine.close()
    return {
        "args": vars(args),
        "device": str(runner.device),
        "per_step_ms": {name: 1e3 * s / n for name, s in seconds.items()},
        "agree_with_dynamic": agree,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="engine-decode-") as tmp:
        result = asyncio.run(bench(args, build_model(args.shape, Path(tmp) / "model")))
    print(f"{args.rows} rows x {args.new_tokens} new tokens, {result['device']}, ms per decode step:")
    base = result["per_step_ms"]["generate#2"]
    for name, ms in result["per_step_ms"].items():
        print(f"  {name:>18}: {ms:8.2f} ms  ({base / ms:.2f}x generate's speed)")
    for mode, share in result["agree_with_dynamic"].items():
        print(f"  greedy tokens equal to dynamic's: {mode} {share:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
