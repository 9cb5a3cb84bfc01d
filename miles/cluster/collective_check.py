"""The interconnect check of `launcher selftest`: all-reduce and broadcast across the job's GPUs (NCCL), or
across its nodes over gloo on CPU-only presets, before anything else takes the GPUs.

One throw-away actor per rank in a placement group of its own (removed afterwards, so the job's cells get
every GPU); rank 0's actor names the rendezvous address. Bandwidth follows nccl-tests' definitions: the
algorithm bandwidth is bytes / time, the bus bandwidth scales it by what each link carries (2(n-1)/n for
all-reduce, 1 for broadcast), so it compares with a link's nominal figure whatever the rank count.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

Backend = Literal["nccl", "gloo"]
Collective = Literal["all_reduce", "broadcast"]
WARMUP = 1
ITERATIONS = 3
GROUP_TIMEOUT_S = 120.0


def bus_factor(collective: Collective, ranks: int) -> float:
    """What each link carries per byte of the buffer (nccl-tests' busBw factor)."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return 1.0 if ranks > 1 else 0.0


@dataclass(frozen=True)
class CollectiveTiming:
    collective: Collective
    nbytes: int
    ranks: int
    seconds: float  # the slowest rank's median over ITERATIONS

    @property
    def algbw_gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.collective, self.ranks)


@dataclass
class CollectiveReport:
    backend: Backend
    ranks: int
    nodes: list[str]
    timings: list[CollectiveTiming] = field(default_factory=list)

    def summary(self, nominal_gbps: float | None) -> str:
        where = f"{self.ranks} rank(s) on {len(set(self.nodes))} node(s), {self.backend}"
        if self.ranks == 1:
            return f"{where}: one rank, nothing crosses a link (the backend initialised and reduced)"
        parts = []
        for t in self.timings:
            size = f"{t.nbytes / 2**20:.0f} MiB"
            text = f"{t.collective} {size} {t.seconds * 1e3:.1f} ms, bus {t.busbw_gbps:.2f} GB/s"
            if nominal_gbps:
                text += f" ({100 * t.busbw_gbps / nominal_gbps:.0f}% of nominal {nominal_gbps:g} GB/s)"
            parts.append(text)
        return f"{where}: " + "; ".join(parts)


def median_of_slowest(per_rank: list[list[float]]) -> float:
    """The collective's time: per iteration the slowest rank's, then the median over iterations."""
    slowest = sorted(max(times) for times in zip(*per_rank, strict=True))
    return slowest[len(slowest) // 2]


@ray.remote(num_cpus=0)
class CollectiveProbe:
    """One rank of the check: joins the group, times the collectives, leaves."""

    def address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return ip, sock.getsockname()[1]

    def run(self, rank: int, ranks: int, master: tuple[str, int], backend: Backend, nbytes: int) -> dict:
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=ranks,
            timeout=_timedelta(GROUP_TIMEOUT_S),
        )
        try:
            buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            times = {
                "all_reduce": _time(lambda: dist.all_reduce(buffer), device),
                "broadcast": _time(lambda: dist.broadcast(buffer, src=0), device),
            }
            return {"node": ray.util.get_node_ip_address(), "times": times}
        finally:
            dist.destroy_process_group()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _time(op: Any, device: Any) -> list[float]:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(WARMUP):
        op()
    sync()
    times = []
    for _ in range(ITERATIONS):
        started = time.perf_counter()
        op()
        sync()
        times.append(time.perf_counter() - started)
    return times


def probe_bundles(nodes: int, gpus_per_node: int, backend: Backend) -> list[dict[str, float]]:
    """NCCL: one bundle per GPU; gloo: one per node (CPU-only presets: logical GPUs are not devices)."""
    if backend == "nccl":
        return [{"GPU": 1.0, "CPU": 0.01} for _ in range(nodes * gpus_per_node)]
    return [{"CPU": 0.01} for _ in range(nodes)]


async def run_collective_check(
    nodes: int, gpus_per_node: int, backend: Backend, nbytes: int, timeout_s: float = 300.0
) -> CollectiveReport:
    bundles = probe_bundles(nodes, gpus_per_node, backend)
    # gloo's ranks must land one per node to cross the network; NCCL's fill each node's GPUs
    strategy = "STRICT_SPREAD" if backend == "gloo" and nodes > 1 else "PACK"
    pg = placement_group(bundles, strategy=strategy, name="miles-selftest-collective")
    try:
        async with asyncio.timeout(timeout_s):
            await pg.ready()
            return await _run_in(pg, bundles, backend, nbytes)
    finally:
        remove_placement_group(pg)


async def _run_in(
    pg: Any, bundles: list[dict[str, float]], backend: Backend, nbytes: int
) -> CollectiveReport:
    probes = [
        CollectiveProbe.options(
            num_gpus=bundle.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote()
        for index, bundle in enumerate(bundles)
    ]
    try:
        master = await probes[0].address.remote()
        results = await asyncio.gather(
            *(
                probe.run.remote(rank, len(probes), master, backend, nbytes)
                for rank, probe in enumerate(probes)
            )
        )
    finally:
        for probe in probes:
            ray.kill(probe)
    report = CollectiveReport(backend, len(probes), [r["node"] for r in results])
    for collective in ("all_reduce", "broadcast"):
        seconds = median_of_slowest([r["times"][collective] for r in results])
        report.timings.append(CollectiveTiming(collective, nbytes, len(probes), seconds))
    return report
