"""A named full-weight sampler save written behind its answer, against writing the same files first.

    python bench/sampler_save.py [--shape tiny|qwen3-0.6b] [--saves 3] [--json out.json]

One full fine-tuning job over the production Ray runtime (bench/gateway_process.py, the CPU engine), through
the tinker SDK. Each round, on the same trained weights:

- `answer`: `save_weights_for_sampler(name)`'s answer. The trainer copies its weights to host memory, the
  engines get them by the push, and the files are written behind (docs/state-and-checkpoints.md);
- `files`: from the save until `list_checkpoints` lists it (the listing waits for the commit);
- `export`: `save_weights_external(name)`, which writes the same safetensors with the same writer before
  it answers: what a named save waited for before, besides its push;
- `push`: the server's push time during the named save (`miles_push_seconds` on /metrics).

The ratio is answer / (export + push): the named save's answer now against what it was. Every round also
samples from the saved path, which must work at once. No assertion: the numbers go to docs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_batching import build_model  # the sibling bench's model builder
from gateway_process import BASE_MODEL, start_ray_gateway
from rich.console import Console
from rich.table import Table
from rl_loop import push_totals

KEY = "tml-sampler-save-bench-0001"
console = Console(stderr=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="tiny", help="a model.init_shape (tiny, qwen3-0.6b, ...)")
    parser.add_argument("--saves", type=int, default=3, help="rounds (the median is reported)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.saves < 1:
        parser.error("--saves must be at least 1")
    return args


def one_round(index: int, service: Any, tc: Any, rest: Any, url: str) -> dict[str, float]:
    from tinker import types

    pushed = push_totals(url)
    start = time.perf_counter()
    path = tc.save_weights_for_sampler(f"behind-{index}").result().path
    answer = time.perf_counter() - start
    pushed_after = push_totals(url)
    sampler = service.create_sampling_client(model_path=path).result()
    sampler.sample(types.ModelInput.from_ints([3, 17, 90]), 1, types.SamplingParams(max_tokens=2)).result()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    files = time.perf_counter() - start
    if f"sampler_weights/behind-{index}" not in listed:
        raise RuntimeError(f"{path} is not listed after its save: {sorted(listed)}")
    start = time.perf_counter()
    tc.save_weights_external(f"export-{index}").result()
    export = time.perf_counter() - start
    push = float("nan")
    if pushed is not None and pushed_after is not None:
        push = pushed_after[0] - pushed[0]
    return {"answer_s": answer, "files_s": files, "export_s": export, "push_s": push}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import tinker
    from tinker import types

    model_dir = build_model(args.shape, workdir / "model")
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    console.print(f"model {args.shape}: {size:,} bytes of safetensors")
    gateway = start_ray_gateway(model_dir, workdir / "gateway", {KEY: "bench"}, "--train-mode", "full")
    try:
        service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY)
        rest = tinker.RestClient(base_url=gateway.url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([3, 17, 90, 4, 55]),
            loss_fn_inputs={"target_tokens": [17, 90, 4, 55, 21], "weights": [1.0] * 5},
        )
        rounds = []
        for index in range(args.saves):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            rounds.append(one_round(index, service, tc, rest, gateway.url))
            console.print(f"round {index}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()))
    finally:
        gateway.stop()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratio = median["answer_s"] / (median["export_s"] + median["push_s"])
    return {"bench": "sampler_save", "shape": args.shape, "rounds": rounds, "median": median, "ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sampler-save-") as tmp:
        result = run(args, Path(tmp))
    table = Table(title=f"named sampler save, {args.shape} (median of {args.saves})", title_justify="left")
    for column in ("answer s", "files s", "export s", "push s", "answer / (export + push)"):
        table.add_column(column, justify="right")
    m = result["median"]
    table.add_row(
        *(f"{m[k]:.3f}" for k in ("answer_s", "files_s", "export_s", "push_s")), f"{result['ratio']:.2f}x"
    )
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
