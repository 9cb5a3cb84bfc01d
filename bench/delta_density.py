"""How much of the bf16 image changes after one AdamW step, and what a delta push would send (issue 36).

    .venv/bin/python bench/delta_density.py [--shape tiny|qwen3-0.6b] [--lrs 1e-5 1e-6]
                                            [--second-step-lr 1e-5] [--batch 2] [--seq 64] [--threads 2]
                                            [--seed 0] [--json out.json [--tensors]]

A `miles.models.tiny` shape with random weights (`qwen3-0.6b`: Qwen3-0.6B's shape, 1.19 GB in bf16, saved
in bf16 as the real checkpoint is) is loaded with transformers in float32 on the CPU: the trainer's fp32
master weights. The engines' image is each parameter cast to bf16. For each `--lrs` learning rate, from
the same initial weights: one forward/backward of cross-entropy on a random `--batch` x `--seq` batch and
one step of the project's AdamW (`miles.train.backends.optim.new_adamw`, Tinker's defaults otherwise),
then the new bf16 image against the old. At `--second-step-lr` a second step follows on a new batch and
is measured against the image after the first: what an RL loop sees once the masters are off the bf16
grid. Per tensor and in total: changed fraction, bytes of dense / sparse / bitmask / xor_zlib / chosen
(`miles.utils.delta.choose`), encode time of each and of `choose`, apply time of each, digest time;
every apply is checked bit for bit and by digest. Also how far the changed values moved, in units of
the last place (their int16 bits' difference, same sign), and the bytes of a form not built yet, bitmask
+ one signed byte per change (`bitmask_int8_est`: escapes at 3 bytes each). The table groups tensors by
kind of parameter; `--json` writes totals and groups (`--tensors`: every tensor's row too). Ratios are
of this run; no assertion. Results: bench/results/delta-density.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch

from miles.utils import delta

KINDS = ("dense", "sparse", "bitmask", "xor_zlib")
Image = dict[str, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", help="a miles.models.tiny shape (tiny, qwen3-0.6b)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-6])
    parser.add_argument("--second-step-lr", type=float, default=1e-5, help="also measure step 2 here")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--tensors", action="store_true", help="with --json: every tensor's row too")
    return parser.parse_args(argv)


def build_model(shape: str, out: Path) -> Path:
    from miles.models.tiny import build_tiny_model, tiny_spec

    return build_tiny_model(out, tiny_spec(shape))


def load_master(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def bf16_image(model: torch.nn.Module) -> Image:
    """What the engines hold: each parameter (a tied weight once) cast to bf16."""
    return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, seed: int):
    """One forward/backward of cross-entropy on a random batch, one optimizer step; the loss and seconds."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return loss.item(), time.perf_counter() - start


def timed(fn, *fn_args) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*fn_args)
    return result, time.perf_counter() - start


def measure_tensor(name: str, old: torch.Tensor, new: torch.Tensor) -> dict[str, Any]:
    """Every form's bytes, encode and apply time for one tensor; each apply checked bit for bit."""
    row: dict[str, Any] = {"name": name, "numel": old.numel(), "bytes": {}, "encode_s": {}, "apply_s": {}}
    new_digest, row["digest_s"] = timed(delta.digest, new)
    for kind in KINDS:
        encoded, row["encode_s"][kind] = timed(delta.ENCODERS[kind], old, new)
        row["bytes"][kind] = encoded.nbytes
        if kind == "sparse":
            row["changed"] = encoded.changed
        target = old.clone()
        _, row["apply_s"][kind] = timed(delta.apply, target, encoded)
        if not torch.equal(target.view(torch.int16), new.view(torch.int16)):
            raise SystemExit(f"{name}: {kind} did not rebuild the new image bit for bit")
    chosen, row["choose_s"] = timed(delta.choose, old, new)
    row["chosen"] = chosen.kind
    row["bytes"]["chosen"] = chosen.nbytes
    row["bytes"]["best_with_xor"] = min(chosen.nbytes, row["bytes"]["xor_zlib"])
    target = old.clone()
    _, row["apply_s"]["chosen"] = timed(delta.apply, target, chosen)
    row["digest_match"] = delta.digest(target) == new_digest
    row["density"] = row["changed"] / max(row["numel"], 1)
    row.update(ulp_moves(old, new))
    row["bytes"]["bitmask_int8_est"] = (
        (row["numel"] + 7) // 8 + row["changed"] + 2 * (row["changed"] - row["ulp_le127"])
    )
    return row


def ulp_moves(old: torch.Tensor, new: torch.Tensor) -> dict[str, int]:
    """Changed elements that moved by exactly 1 ulp, and by at most 127 (their bits' difference)."""
    old_bits, new_bits = old.view(torch.int16).reshape(-1), new.view(torch.int16).reshape(-1)
    changed = old_bits != new_bits
    moved = (new_bits[changed].int() - old_bits[changed].int()).abs()
    return {"ulp_1": int((moved == 1).sum()), "ulp_le127": int((moved <= 127).sum())}


def group_of(name: str) -> str:
    """The kind of parameter: the name without `model.` and the layer number."""
    return re.sub(r"^model\.(layers\.\d+\.)?", "", name)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over `rows`: elements, changed, bytes and seconds of every form, kinds chosen."""
    total: dict[str, Any] = {
        "tensors": len(rows),
        "numel": sum(r["numel"] for r in rows),
        "changed": sum(r["changed"] for r in rows),
        "ulp_1": sum(r["ulp_1"] for r in rows),
        "ulp_le127": sum(r["ulp_le127"] for r in rows),
        "bytes": {k: sum(r["bytes"][k] for r in rows) for k in rows[0]["bytes"]},
        "encode_s": {k: sum(r["encode_s"][k] for r in rows) for k in KINDS},
        "apply_s": {k: sum(r["apply_s"][k] for r in rows) for k in (*KINDS, "chosen")},
        "choose_s": sum(r["choose_s"] for r in rows),
        "digest_s": sum(r["digest_s"] for r in rows),
        "chosen_kinds": dict(sorted(_count(r["chosen"] for r in rows).items())),
        "all_digests_match": all(r["digest_match"] for r in rows),
    }
    total["density"] = total["changed"] / max(total["numel"], 1)
    total["density_min"] = min(r["density"] for r in rows)
    total["density_max"] = max(r["density"] for r in rows)
    total["full_over_chosen"] = total["bytes"]["dense"] / max(total["bytes"]["chosen"], 1)
    total["full_over_best_with_xor"] = total["bytes"]["dense"] / max(total["bytes"]["best_with_xor"], 1)
    return total


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for item in items:
        counts[item] += 1
    return counts


def measure_image(old: Image, new: Image) -> dict[str, Any]:
    rows = [measure_tensor(name, old[name], new[name]) for name in old]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[group_of(row["name"])].append(row)
    return {
        "total": summarize(rows),
        "groups": {g: summarize(rs) for g, rs in groups.items()},
        "tensors": rows,
    }


def run_lr(model_dir: Path, initial: Image, lr: float, steps: int, args: argparse.Namespace) -> list[dict]:
    """From the initial weights: `steps` AdamW steps at `lr`, each measured against the image before it."""
    from miles.train.backends.optim import new_adamw
    from miles.types import AdamParams

    model = load_master(model_dir)
    optimizer = new_adamw(list(model.parameters()), AdamParams(learning_rate=lr))
    runs = []
    before = initial
    for step in range(1, steps + 1):
        loss, step_s = adamw_step(model, optimizer, args, seed=args.seed + 1000 * step)
        after = bf16_image(model)
        result = measure_image(before, after)
        result.update(lr=lr, step=step, loss=loss, step_s=step_s)
        runs.append(result)
        print_run(result)
        before = after
    del model, optimizer
    gc.collect()
    return runs


def mb(n: float) -> str:
    return f"{n / 1e6:10.2f}"


def print_run(run: dict[str, Any]) -> None:
    total = run["total"]
    print(
        f"\nlr {run['lr']:g} step {run['step']} (loss {run['loss']:.3f}, step {run['step_s']:.1f} s): "
        f"{total['changed']}/{total['numel']} changed = {total['density']:.4%}, "
        f"full/chosen {total['full_over_chosen']:.2f}x, digests match: {total['all_digests_match']}"
    )
    header = (
        f"{'group':<34}{'tensors':>8}{'density':>10}{'dense MB':>11}{'chosen MB':>11}{'ratio':>8}  chosen"
    )
    print(header)
    print("-" * len(header))
    for name, g in [*sorted(run["groups"].items()), ("TOTAL", total)]:
        chosen = g["bytes"]["chosen"]
        ratio = f"{g['bytes']['dense'] / chosen:>8.2f}" if chosen else f"{'(none)':>8}"
        kinds = ", ".join(f"{k} {n}" for k, n in g["chosen_kinds"].items())
        print(
            f"{name:<34}{g['tensors']:>8}{g['density']:>10.4%}{mb(g['bytes']['dense']):>11}"
            f"{mb(chosen):>11}{ratio}  {kinds}"
        )


def print_summary(runs: list[dict[str, Any]]) -> None:
    print("\nTotals (MB = 1e6 bytes; seconds summed over tensors, 1 process)")
    head = f"{'run':<16}{'density':>9}" + "".join(f"{k + ' MB':>13}" for k in (*KINDS, "chosen"))
    print(head + f"{'full/chosen':>12}{'w/ xor':>8}{'1 ulp':>8}{'<=127':>8}{'b+int8 MB':>11}")
    for run in runs:
        t = run["total"]
        label = f"lr {run['lr']:g} s{run['step']}"
        sizes = "".join(f"{mb(t['bytes'][k]):>13}" for k in (*KINDS, "chosen"))
        print(
            f"{label:<16}{t['density']:>9.4%}{sizes}{t['full_over_chosen']:>11.2f}x"
            f"{t['full_over_best_with_xor']:>7.2f}x{t['ulp_1'] / max(t['changed'], 1):>8.2%}"
            f"{t['ulp_le127'] / max(t['changed'], 1):>8.2%}{mb(t['bytes']['bitmask_int8_est']):>11}"
        )
    head = f"{'run':<16}" + "".join(f"{'enc ' + k:>13}" for k in (*KINDS, "choose"))
    print("\n" + head + "".join(f"{'apply ' + k:>15}" for k in (*KINDS, "chosen")) + f"{'digest':>9}")
    for run in runs:
        t = run["total"]
        label = f"lr {run['lr']:g} s{run['step']}"
        enc = "".join(f"{t['encode_s'][k]:>12.3f}s" for k in KINDS) + f"{t['choose_s']:>12.3f}s"
        app = "".join(f"{t['apply_s'][k]:>14.3f}s" for k in (*KINDS, "chosen"))
        print(f"{label:<16}{enc}{app}{t['digest_s']:>8.3f}s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(args.threads, 1))
    torch.manual_seed(args.seed)
    lrs = list(args.lrs)
    if args.second_step_lr and args.second_step_lr not in lrs:
        lrs.append(args.second_step_lr)
    with tempfile.TemporaryDirectory(prefix="delta-density-") as tmp:
        model_dir = build_model(args.shape, Path(tmp) / "model")
        master = load_master(model_dir)
        initial = bf16_image(master)
        del master
        gc.collect()
        runs = []
        for lr in lrs:
            runs.extend(run_lr(model_dir, initial, lr, 2 if lr == args.second_step_lr else 1, args))
    print_summary(runs)
    if args.json:
        result = {
            "args": vars(args),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "loadavg_at_end": os.getloadavg(),  # other processes share the CPU: timings scale with it
            },
            "runs": runs if args.tensors else [{k: v for k, v in r.items() if k != "tensors"} for r in runs],
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
