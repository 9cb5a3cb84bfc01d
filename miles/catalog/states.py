"""The instance state machine: every allowed move in one table.

STARTING -> READY -> (QUARANTINED | FAILED) -> RELEASING -> RELEASED; STARTING -> FAILED when the start
fails. RELEASING is left only by a completed backend stop, so GPUs return to the pool exactly once.
"""

from __future__ import annotations

from enum import StrEnum

from miles.errors import IllegalTransition


class InstanceState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    QUARANTINED = "quarantined"  # an operation timed out: no new work, even if its actors answer ping
    FAILED = "failed"  # its start failed or its actors died
    RELEASING = "releasing"  # the backend is stopping it; its GPUs are still counted as used
    RELEASED = "released"  # stopped; its GPUs are back in the pool


TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.STARTING: frozenset({InstanceState.READY, InstanceState.FAILED}),
    InstanceState.READY: frozenset(
        {InstanceState.QUARANTINED, InstanceState.FAILED, InstanceState.RELEASING}
    ),
    InstanceState.QUARANTINED: frozenset({InstanceState.RELEASING}),
    InstanceState.FAILED: frozenset({InstanceState.RELEASING}),
    InstanceState.RELEASING: frozenset({InstanceState.RELEASED}),
    InstanceState.RELEASED: frozenset(),
}

# States in which an instance still holds its GPUs.
HOLDS_GPUS = frozenset(set(InstanceState) - {InstanceState.RELEASED})
# States in which new tenants may be placed on it (STARTING: they wait on the same start).
ACCEPTS_TENANTS = frozenset({InstanceState.STARTING, InstanceState.READY})


def check_transition(instance_id: str, current: InstanceState, target: InstanceState) -> None:
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(f"instance {instance_id}: {current.value} -> {target.value} is not allowed")
