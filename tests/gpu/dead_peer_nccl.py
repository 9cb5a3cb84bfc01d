"""What a kept NCCL weight-update group does when a member dies (two GPUs; prints one JSON line).

    python3 tests/gpu/dead_peer_nccl.py [--leave abort|destroy]

Rank 0 (this process, GPU 0) is the trainer; rank 1 (a child process, GPU 1) is an engine. They join
with `create_weight_update_group` and move one buffer; then the engine dies (os._exit). The trainer
then broadcasts again, as the next push over a kept group would, and leaves the group with `--leave`:
`abort` (GroupHandle.abort, what the push's failure path uses) or `destroy` (the graceful shutdown a
successful per-push group used). Every wait is bounded, so a hang shows as a timeout, not a stuck run.
Last, a new engine process (the respawn) joins a fresh group with the same trainer and receives a
buffer bit for bit: the trainer process is still usable.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from miles.engines.weight_group import create_weight_update_group, pick_master_port

NBYTES = 64 << 20


def _join(port: int, rank: int, name: str) -> Any:
    return create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, backend="nccl",
        group_name=name, timeout_s=60,
    )  # fmt: skip


def engine(port: int, name: str, die: bool) -> None:
    torch.cuda.set_device(1)
    group = _join(port, 1, name)
    buffer = torch.empty(NBYTES, dtype=torch.uint8, device="cuda:1")
    group.broadcast(buffer, src=0)
    torch.cuda.synchronize()
    if die:
        os._exit(0)  # an engine killed between pushes: no shutdown of its communicator
    expected = torch.arange(NBYTES, dtype=torch.int64, device="cuda:1").remainder(251).to(torch.uint8)
    os._exit(0 if torch.equal(buffer, expected) else 3)


def bounded(fn: Any, timeout_s: float) -> tuple[bool, float, str]:
    """(finished, seconds, error) of fn() in a daemon thread, waiting at most timeout_s."""
    box: dict[str, str] = {}

    def target() -> None:
        try:
            fn()
        except Exception as exc:  # the outcome is reported, not raised
            box["error"] = f"{type(exc).__name__}: {exc}"[:300]

    start = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), round(time.perf_counter() - start, 3), box.get("error", "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leave", choices=("abort", "destroy"), default="abort")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"leave": args.leave}

    port = pick_master_port("127.0.0.1")
    child = ctx.Process(target=engine, args=(port, "kept", True))
    child.start()
    group = _join(port, 0, "kept")
    payload = torch.arange(NBYTES, dtype=torch.int64, device="cuda:0").remainder(251).to(torch.uint8)
    group.broadcast(payload, src=0)
    torch.cuda.synchronize()
    child.join(30)
    out["engine_exit"] = child.exitcode

    work: dict[str, Any] = {}
    out["broadcast_to_dead_returns"] = bounded(lambda: work.update(w=group.broadcast_async(payload)), 10)
    time.sleep(2)
    out["broadcast_completed_after_2s"] = bool(work.get("w") and work["w"].is_completed())
    out["leave_returns"] = bounded(group.abort if args.leave == "abort" else group.destroy, 10)
    out["device_sync_returns"] = bounded(torch.cuda.synchronize, 10)

    port = pick_master_port("127.0.0.1")
    respawned = ctx.Process(target=engine, args=(port, "fresh", False))
    respawned.start()

    def rejoin() -> None:
        fresh = _join(port, 0, "fresh")
        fresh.broadcast(payload, src=0)
        torch.cuda.synchronize()
        respawned.join(30)
        fresh.destroy()

    out["respawned_engine_rejoins"] = bounded(rejoin, 25)
    out["respawned_engine_got_every_byte"] = respawned.exitcode == 0
    print(json.dumps(out), flush=True)
    os._exit(0)  # a communicator left hanging must not hold the exit


if __name__ == "__main__":
    main()
