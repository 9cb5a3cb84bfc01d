"""Where one operation's time goes: `time.perf_counter_ns` stamps carried on the operation.

A `StageClock` starts when the route takes the request; each step of the path ends a stage with `mark`
(the time since the previous mark), and a duration measured elsewhere (the backend's compute, taken on the
trainer rank) is `split` out of the stage that contains it. `retrieve_future` answers the stages in the
`X-Miles-Stages` header (`name=milliseconds,...`, in the order they happened), which the request log keeps
and `bench/gateway.py` summarises. The clocks live in memory only, in a bounded map: instrumentation,
never state.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from miles.types import TimedPart

STAGES_HEADER = "X-Miles-Stages"
# enough for every operation a busy gateway has in flight or just answered; older clocks are dropped
MAX_KEPT_CLOCKS = 4096


@dataclass
class StageClock:
    """Durations (ns) of the stages passed so far, in order; a stage named twice adds up."""

    last_ns: int = field(default_factory=time.perf_counter_ns)
    stages: dict[str, int] = field(default_factory=dict)
    ranks_ns: tuple[int, ...] = ()  # each trainer rank's share of the compute stage (forward_backward)
    parts: list[TimedPart] = field(default_factory=list)  # work below the gateway: pushes, generations

    def mark(self, stage: str) -> None:
        """End `stage` now: it took the time since the previous mark (or since the clock started)."""
        now = time.perf_counter_ns()
        self.stages[stage] = self.stages.get(stage, 0) + now - self.last_ns
        self.last_ns = now

    def split(self, stage: str, inner: str, inner_ns: int) -> None:
        """`inner_ns` of the already marked `stage` was spent in `inner` (measured elsewhere)."""
        taken = min(max(inner_ns, 0), self.stages.get(stage, 0))
        self.stages[stage] = self.stages.get(stage, 0) - taken
        self.stages[inner] = self.stages.get(inner, 0) + taken

    def header(self) -> str:
        return ",".join(f"{name}={ns / 1e6:.3f}" for name, ns in self.stages.items())


def parse_stages(header: str) -> dict[str, float]:
    """`name=ms,...` (the `X-Miles-Stages` header) -> {name: milliseconds}."""
    out: dict[str, float] = {}
    for item in header.split(","):
        name, sep, value = item.partition("=")
        if sep:
            out[name.strip()] = float(value)
    return out


class StageClocks:
    """request_id -> its StageClock, the newest MAX_KEPT_CLOCKS kept."""

    def __init__(self, limit: int = MAX_KEPT_CLOCKS) -> None:
        self._limit = limit
        self._clocks: OrderedDict[str, StageClock] = OrderedDict()

    def keep(self, request_id: str, clock: StageClock) -> None:
        self._clocks[request_id] = clock
        self._clocks.move_to_end(request_id)
        while len(self._clocks) > self._limit:
            self._clocks.popitem(last=False)

    def get(self, request_id: str) -> StageClock | None:
        return self._clocks.get(request_id)
