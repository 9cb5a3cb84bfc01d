"""The colocated weight push between two processes on one device: handles per tensor against one flattened
bucket (SGLang's `load_format="flattened_bucket"`), the product code on both sides.

    python bench/ipc_push.py [--device cuda] [--shape qwen3-0.6b] [--rounds 5] [--bucket-mb 2048]
                              [--json PATH]

The trainer's place (this process): a TransformersBackend holding the model on the device, sharing its
weights with `ShareWeightBuckets` (miles/weights/ipc_sender.py) as the colocated push does. The engine's
place (a spawned process): the CPU engine's `Engine` on the same device, loading every payload with
`load_tensor_payload` as `/update_weights_from_tensor` does (miles/engines/cpu/engine.py). Per round and form:

- `share`: ShareWeightBuckets on the trainer (the flattened form's copy into its buckets included), and its
  parts as the rank reports them (plan: the walk and buckets, kept after the first push; pack: launching
  the copies; handles: the IPC handles and pickles);
- `unpickle`: the engine unpickling the payloads (opening the IPC handles: one per storage, or per bucket);
- `copy`: the engine copying into its parameters, synchronised;
- `total`: share + the engine's answer for every bucket + ReleaseSharedWeights, as the push waits for them
  (`--to-device`: the release empties the trainer's cache after copies, as a memory-tight job's does).

Forms alternate within a round, after one warm-up round of each; medians over `--rounds`. Each round the
engine's loaded weights are checked against the trainer's, tensor by tensor (sums). No assertion: the
numbers go to docs/colocation.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: miles.*
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_batching import build_model  # the sibling bench: the same model builder

FORMS = {"tensors": False, "flattened": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=2048.0, help="the preset's runtime.push_bucket_mb")
    parser.add_argument(
        "--to-device",
        action="store_true",
        help="empty the trainer's cache after each push, as a memory-tight job does (ipc_copies_to_device)",
    )
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def engine_process(model_dir: str, conn: Any) -> None:
    """The engine's place: load each round's payloads, answer the timings and a checksum of its weights."""
    from miles.engines.cpu.engine import Engine

    async def serve() -> None:
        engine = Engine(model_dir)
        await engine.load()
        await engine.wait_loaded()
        conn.send(str(engine.model().device))
        while (message := conn.recv()) is not None:
            before = engine.tensor_loads.as_dict()
            started = time.perf_counter()
            for payload, load_format in message:  # each bucket in the form the trainer chose for it
                await engine.load_tensor_payload(payload, flattened=load_format == "flattened_bucket")
            seconds = time.perf_counter() - started
            after = engine.tensor_loads.as_dict()
            params = engine.model().params  # a tied lm_head is here too, under its own name
            sums = {name: float(p.detach().float().sum().item()) for name, p in params.items()}
            conn.send(
                {
                    "load_s": seconds,
                    "unpickle_s": after["unpickle_s"] - before["unpickle_s"],
                    "copy_s": after["copy_s"] - before["copy_s"],
                    "tensors": after["tensors"] - before["tensors"],
                    "sums": sums,
                }
            )
        await engine.close()

    asyncio.run(serve())


def trainer_sums(backend: Any) -> dict[str, float]:
    from miles.weights.sender import pushed_weights

    return {name: float(t.detach().float().sum().item()) for name, t in pushed_weights(backend)}


def worst_difference(sent: dict[str, float], loaded: dict[str, float]) -> float:
    """The largest relative difference between a pushed tensor's sum and the engine's same tensor."""
    missing = sorted(set(sent) - set(loaded))
    if missing:
        raise SystemExit(f"the engine has no parameter for {missing[:5]}")
    return max(abs(loaded[name] - value) / max(abs(value), 1e-6) for name, value in sent.items())


def one_push(
    backend: Any, conn: Any, bucket_bytes: int, flattened: bool, to_device: bool
) -> dict[str, float]:
    import torch

    from miles.weights.ipc_sender import ReleaseSharedWeights, ShareWeightBuckets

    sent = trainer_sums(backend)
    started = time.perf_counter()
    shared = ShareWeightBuckets(bucket_bytes, flattened).run(backend)
    if shared.error:
        raise SystemExit(f"the trainer could not share its weights: {shared.error}")
    shared_at = time.perf_counter()
    conn.send(list(zip(shared.payloads, shared.load_formats, strict=True)))
    answer = conn.recv()
    ReleaseSharedWeights(to_device).run(backend)
    total = time.perf_counter() - started
    with torch.no_grad():  # the next round sends other weights, as after an optimizer step
        for _, tensor in backend.iter_hf_weights():
            tensor.mul_(0.999)
    return {
        "share_s": shared_at - started,
        **{f"share_{part}_s": seconds for part, seconds in shared.seconds.items()},
        "unpickle_s": answer["unpickle_s"],
        "copy_s": answer["copy_s"],
        "total_s": total,
        "buckets": len(shared.payloads),
        "copied": sum(form is not None for form in shared.load_formats),
        "tensors": answer["tensors"],
        "checksum_rel": worst_difference(sent, answer["sums"]),  # 0: the engine holds what was sent
    }


def bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch

    from miles.train.backends.transformers_backend import TransformersBackend

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    backend = TransformersBackend(str(model_dir), train_mode="full", device=args.device, dtype=dtype)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=engine_process, args=(str(model_dir), child_conn), daemon=True)
    child.start()
    try:
        engine_device = conn.recv()
        bucket_bytes = int(args.bucket_mb * (1 << 20))
        rows: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
        for round_ in range(args.rounds + 1):
            for form, flattened in FORMS.items():
                row = one_push(backend, conn, bucket_bytes, flattened, args.to_device)
                if round_ > 0:  # round 0 warms both forms up
                    rows[form].append(row)
        conn.send(None)
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
    medians = {
        form: {key: statistics.median(r[key] for r in form_rows) for key in form_rows[0]}
        for form, form_rows in rows.items()
    }
    return {
        "args": vars(args),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "engine_device": engine_device,
        "rows": rows,
        "medians": medians,
        "ratio_total": medians["flattened"]["total_s"] / medians["tensors"]["total_s"],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="ipc-push-") as tmp:
        result = bench(args, build_model(args.shape, Path(tmp) / "model"))
    print(f"{args.shape} on {result['device']}, medians of {args.rounds} pushes, ms:")
    print(
        f"  {'form':>10} {'buckets':>8} {'tensors':>8} {'share':>8} {'unpickle':>9} {'copy':>8} {'total':>8}"
    )
    for form, m in result["medians"].items():
        print(
            f"  {form:>10} {m['buckets']:>8.0f} {m['tensors']:>8.0f} {m['share_s'] * 1e3:>8.1f} "
            f"{m['unpickle_s'] * 1e3:>9.1f} {m['copy_s'] * 1e3:>8.1f} {m['total_s'] * 1e3:>8.1f}"
        )
    print(f"  flattened / tensors, total: {result['ratio_total']:.2f}x")
    for form, m in result["medians"].items():
        parts = ", ".join(
            f"{key.removeprefix('share_').removesuffix('_s')} {value * 1e3:.1f}"
            for key, value in m.items()
            if key.startswith("share_") and key != "share_s"
        )
        print(f"  {form}: the trainer's share, ms: {parts}")
    worst = max(r["checksum_rel"] for rows in result["rows"].values() for r in rows)
    print(f"  the engine's tensors against the trainer's, worst relative difference of sums: {worst:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
