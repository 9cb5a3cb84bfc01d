"""The weight-update group across two real processes, one of which already has its own default group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.engines.weight_group import create_weight_update_group, pick_master_port

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from miles.engines.weight_group import create_weight_update_group

    rank, port, default_port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    if default_port:
        # This process is a trainer with data parallelism of its own: a default group already exists.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1)
    group = create_weight_update_group(
        master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, backend="gloo",
        group_name="weights-test", timeout_s=60,
    )
    if rank == 0:
        tensors = [torch.arange(6.0).reshape(2, 3), torch.full((4,), 7, dtype=torch.bfloat16)]
    else:
        tensors = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)]
    works = [group.broadcast_async(t, src=0) for t in tensors]
    for work in works:
        work.wait()
    group.broadcast(tensors[0], src=0)
    result = {
        "tensors": [t.float().tolist() for t in tensors],
        "default_world": dist.get_world_size() if dist.is_initialized() else None,
    }
    group.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    json.dump(result, open(out, "w"))
    """
)


def test_two_processes_broadcast_even_with_a_default_group(tmp_path: Path) -> None:
    port, default_port = pick_master_port("127.0.0.1"), pick_master_port("127.0.0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, *map(str, (rank, port, dp, tmp_path / f"r{rank}.json"))],
            env=env,
        )
        for rank, dp in ((0, default_port), (1, 0))
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    r0, r1 = (json.loads((tmp_path / f"r{rank}.json").read_text()) for rank in (0, 1))
    expected = [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [7.0] * 4]
    assert r0["tensors"] == r1["tensors"] == expected
    assert r0["default_world"] == 1, "the trainer's own default group must be left alone"
    assert r1["default_world"] is None, "the engine side must not create a default group"


def test_bad_arguments_are_refused_before_any_rendezvous() -> None:
    common = {"master_address": "127.0.0.1", "group_name": "g", "timeout_s": 1}
    with pytest.raises(ValueError, match="backend"):
        create_weight_update_group(master_port=1234, rank=0, world_size=2, backend="mpi", **common)
    with pytest.raises(ValueError, match="outside the group"):
        create_weight_update_group(master_port=1234, rank=2, world_size=2, backend="gloo", **common)
    with pytest.raises(ValueError, match="TCP port"):
        create_weight_update_group(master_port=0, rank=0, world_size=2, backend="gloo", **common)


def test_members_that_connect_before_rank_0_joins_find_its_store_listening() -> None:
    """The push opens rank 0's store at Describe: members joining first must not be refused (and then
    back off); the group forms with the store handed to rank 0's join."""
    import threading

    import torch

    from miles.engines.weight_group import listen_as_master

    port = pick_master_port("127.0.0.1")
    store = listen_as_master("127.0.0.1", port, timeout_s=30)
    groups: dict[int, object] = {}

    def member(rank: int) -> None:
        groups[rank] = create_weight_update_group(
            master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, backend="gloo",
            group_name="early", timeout_s=30, store=store if rank == 0 else None,
        )  # fmt: skip

    early = threading.Thread(target=member, args=(1,))
    early.start()
    member(0)
    early.join(30)
    buffer = torch.arange(4, dtype=torch.float32)
    received = torch.zeros(4)
    sender = threading.Thread(target=groups[0].broadcast, args=(buffer,))
    sender.start()
    groups[1].broadcast(received)
    sender.join(30)
    assert torch.equal(received, buffer)
    for group in groups.values():
        group.destroy()
