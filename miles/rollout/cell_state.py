"""Engine cell lifecycle: every allowed transition is in TRANSITIONS, nowhere else.

NEW -> STARTING -> PENDING_WEIGHTS -> READY. PENDING_WEIGHTS = the engine answers /health but its weights
are not (or no longer) the trainer's current ones: it is never routed to. A push moves its engines from
READY back to PENDING_WEIGHTS when it starts (a half-updated engine must not serve) and to READY only when
it succeeds. FAILED -> STARTING is a respawn on the same bundle. LENT: the engine process is stopped and
its GPUs are lent to the trainer as a hybrid lane (docs/elastic.md); LENT -> STARTING is its return.
RELEASED (colocated jobs, docs/colocation.md): the engine process is up but has released its GPU memory
(SGLang's release_memory_occupation) while the trainer works on the same GPUs; never routed to, probed
through a route that needs no GPU. RELEASED -> PENDING_WEIGHTS once it resumed its memory: it serves again
only after the push that follows.
"""

from __future__ import annotations

import enum

from miles.errors import IllegalTransition


class CellState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    PENDING_WEIGHTS = "pending_weights"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"
    LENT = "lent"
    RELEASED = "released"


TRANSITIONS: dict[CellState, frozenset[CellState]] = {
    CellState.NEW: frozenset({CellState.STARTING, CellState.STOPPED}),
    CellState.STARTING: frozenset({CellState.PENDING_WEIGHTS, CellState.FAILED, CellState.STOPPED}),
    CellState.PENDING_WEIGHTS: frozenset(
        {CellState.READY, CellState.FAILED, CellState.STOPPED, CellState.LENT, CellState.RELEASED}
    ),
    CellState.READY: frozenset(
        {CellState.PENDING_WEIGHTS, CellState.FAILED, CellState.STOPPED, CellState.RELEASED}
    ),
    CellState.RELEASED: frozenset({CellState.PENDING_WEIGHTS, CellState.FAILED, CellState.STOPPED}),
    CellState.FAILED: frozenset({CellState.STARTING, CellState.STOPPED}),
    CellState.STOPPED: frozenset(),
    CellState.LENT: frozenset({CellState.STARTING, CellState.STOPPED}),
}

# States in which the engine process is up and answers HTTP.
SERVING_STATES = frozenset({CellState.PENDING_WEIGHTS, CellState.READY})


def check_transition(name: str, old: CellState, new: CellState) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{name}: {old.value} -> {new.value} is not an allowed transition")
