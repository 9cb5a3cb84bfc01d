"""Where placement-group bundles landed, and their order: the job's role plan (`miles.contract.roles`),
then GPU id.

The order of nodes (numeric IP, the head last) is decided once, by `miles.contract.roles`; this module only
applies a plan to the bundles Ray placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.contract.roles import RolePlan


class OrderingError(ValueError):
    """A bundle landed on a node the role plan does not know."""


@dataclass(frozen=True)
class BundleLocation:
    """Where one bundle of a placement group landed, as its InfoActor reported it."""

    bundle_index: int
    node_ip: str
    gpu_id: int
    node_id: str = ""


def sort_bundles_by_plan(bundles: Sequence[BundleLocation], plan: RolePlan) -> list[BundleLocation]:
    """Bundles in role order: by their node's place in the plan (head last), then GPU id."""
    position = plan.positions()
    strangers = sorted({b.node_ip for b in bundles} - position.keys())
    if strangers:
        raise OrderingError(
            f"bundles landed on {', '.join(strangers)}, which the role plan does not list "
            f"({', '.join(position)}): is another job's Ray node in this cluster?"
        )
    return sorted(bundles, key=lambda b: (position[b.node_ip], b.node_id, b.gpu_id))
