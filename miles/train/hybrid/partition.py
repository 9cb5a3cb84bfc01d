"""Who computes which datums: a deterministic, order-preserving split of a batch across live lanes.

Pure. Each lane takes one contiguous run of datums, sized by its measured speed (tokens per second), so the
lanes finish together; concatenating the runs in lane order gives back the batch in order. The split never
changes *what* the optimizer consumes: losses are sums over datums (miles/train/losses.py), so the global
normaliser is 1 on every lane and the summed gradient equals the single-lane one up to reduction order.
A lane with no datums still joins the reduction (with a zero gradient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneShare:
    lane: str
    start: int  # [start, end) into the batch
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def validate_speeds(speeds: Sequence[tuple[str, float]]) -> None:
    if not speeds:
        raise ValueError("a partition needs at least one live lane")
    names = [lane for lane, _ in speeds]
    if len(set(names)) != len(names):
        raise ValueError(f"lane names must be unique, got {names}")
    bad = [f"{lane}={speed!r}" for lane, speed in speeds if not (math.isfinite(speed) and speed > 0)]
    if bad:
        raise ValueError(f"lane speeds must be finite and > 0 (measured tokens/s): {', '.join(bad)}")


def partition(costs: Sequence[int], speeds: Sequence[tuple[str, float]]) -> list[LaneShare]:
    """One contiguous share per lane, in the order of `speeds`.

    `costs`: each datum's work (its token count). A datum goes to the lane whose slice of the total cost
    (proportional to its speed) holds the datum's midpoint; the midpoints increase, so shares are
    contiguous and in order, every datum lands exactly once, and a slow lane may get none."""
    validate_speeds(speeds)
    if any(cost < 0 for cost in costs):
        raise ValueError("datum costs must be >= 0")
    total_cost = float(sum(costs))
    total_speed = float(sum(speed for _, speed in speeds))
    # the cost at which each lane's slice ends; the last one is +inf so rounding never drops a datum
    bounds = []
    running = 0.0
    for _, speed in speeds[:-1]:
        running += speed
        bounds.append(total_cost * running / total_speed)
    bounds.append(math.inf)
    owners = []
    lane_index, prefix = 0, 0.0
    for cost in costs:
        midpoint = prefix + cost / 2.0
        while midpoint >= bounds[lane_index]:
            lane_index += 1
        owners.append(lane_index)
        prefix += cost
    shares = []
    for index, (lane, _) in enumerate(speeds):
        start = next((i for i, owner in enumerate(owners) if owner >= index), len(costs))
        end = next((i for i, owner in enumerate(owners) if owner > index), len(costs))
        shares.append(LaneShare(lane, start, end))
    return shares
