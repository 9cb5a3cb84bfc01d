"""Lifecycle of one generation request inside the engine (one table of allowed transitions)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Phase(Enum):
    WAITING = "waiting"  # registered, not admitted yet (engine paused or a weight update holds the gate)
    RUNNING = "running"  # admitted, holds a KV cache, stepping
    PAUSED_IN_PLACE = "paused_in_place"  # pause mode in_place: keeps its KV cache, waits for continue
    RETRACTED = "retracted"  # pause mode retract: KV cache dropped, recomputed on continue
    FINISHED = "finished"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.RUNNING, Phase.FINISHED}),
    Phase.RUNNING: frozenset({Phase.PAUSED_IN_PLACE, Phase.RETRACTED, Phase.FINISHED}),
    Phase.PAUSED_IN_PLACE: frozenset({Phase.RUNNING, Phase.FINISHED}),
    Phase.RETRACTED: frozenset({Phase.RUNNING, Phase.FINISHED}),
    Phase.FINISHED: frozenset(),
}
HOLDS_KV = frozenset({Phase.RUNNING, Phase.PAUSED_IN_PLACE})


@dataclass
class RequestHandle:
    rid: str
    phase: Phase = Phase.WAITING
    aborted: bool = False
    num_retractions: int = 0
    state: Any = None  # the request's GenState (sequence.py), once it generates: a version change marks it

    def move(self, new: Phase) -> None:
        if new not in ALLOWED[self.phase]:
            raise RuntimeError(f"request {self.rid}: illegal transition {self.phase.value} -> {new.value}")
        self.phase = new
