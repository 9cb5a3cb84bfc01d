"""How an actor call's latency grows with the time the actor spends on the call (issue 24, fifth pass).

    .venv/bin/python bench/ray_pause_floor.py [--calls 40] [--pauses-ms 0 5 10 20]

The trainer's `dispatch` on the Ray runtime costs 3-4 ms around a 16-20 ms compute, against about 1 ms for
a call answered at once. This separates the two legs: an actor sleeps (or spins) for each pause and
answers its own wall clock at return; the caller, awaiting from an asyncio loop, a plain `ray.get`, or
polling `ray.wait(timeout=0)` in a spin, records the whole call less the pause (p50) and the time from the
actor's return to the caller seeing the answer (return -> caller, p50; one host, one clock). If the
growth is in the caller's waiting, the spinning caller does not show it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import ray


@ray.remote(num_cpus=0)
class PauseActor:
    def run(self, pause_s: float, busy: bool) -> float:
        if busy:
            end = time.perf_counter() + pause_s
            while time.perf_counter() < end:
                pass
        elif pause_s:
            time.sleep(pause_s)
        return time.time()


def _blocking_get(actor: ray.actor.ActorHandle, pause_s: float, busy: bool) -> float:
    return ray.get(actor.run.remote(pause_s, busy))


def _spinning_get(actor: ray.actor.ActorHandle, pause_s: float, busy: bool) -> float:
    ref = actor.run.remote(pause_s, busy)
    while not ray.wait([ref], timeout=0)[0]:
        pass
    return ray.get(ref)


def _row(call: Callable[[], float], pause_s: float, calls: int) -> tuple[float, float]:
    overhead, tail = [], []
    for _ in range(calls):
        start = time.perf_counter()
        returned_at = call()
        overhead.append((time.perf_counter() - start - pause_s) * 1000)
        tail.append((time.time() - returned_at) * 1000)
    return statistics.median(overhead), statistics.median(tail)


async def _awaited_rows(actor: ray.actor.ActorHandle, pauses: list[float], calls: int) -> list[str]:
    lines = []
    for pause in pauses:
        for busy in (False, True):
            overhead, tail = [], []
            for _ in range(calls):
                start = time.perf_counter()
                returned_at = await actor.run.remote(pause, busy)
                overhead.append((time.perf_counter() - start - pause) * 1000)
                tail.append((time.time() - returned_at) * 1000)
            how = "busy" if busy else "asleep"
            lines.append(_line("awaited", pause, how, statistics.median(overhead), statistics.median(tail)))
    return lines


def _line(caller: str, pause_s: float, how: str, overhead: float, tail: float) -> str:
    return f"  {caller:<14} {pause_s * 1000:5.0f} ms {how:<7} {overhead:8.2f} {tail:16.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--pauses-ms", type=float, nargs="+", default=[0.0, 5.0, 10.0, 20.0])
    args = parser.parse_args()
    pauses = [ms / 1000 for ms in args.pauses_ms]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = PauseActor.remote()
        ray.get(actor.run.remote(0.0, False))
        print(f"actor call, p50 ms over {args.calls} calls: the call less the pause, and return -> caller")
        print(f"  {'caller':<14} {'pause':>8} {'':<7} {'overhead':>8} {'return -> caller':>16}")
        for line in asyncio.run(_awaited_rows(actor, pauses, args.calls)):
            print(line)
        for name, get in (("ray.get", _blocking_get), ("ray.wait spin", _spinning_get)):
            for pause in pauses:
                overhead, tail = _row(lambda p=pause, g=get: g(actor, p, False), pause, args.calls)
                print(_line(name, pause, "asleep", overhead, tail))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
