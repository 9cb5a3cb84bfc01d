"""Stable names for one instance's Ray actors and placement group, so a restarted driver finds them again.

A catalog instance's actors are created by the driver; without names (and, to outlive the driver,
`lifetime="detached"`) a restarted controller has nothing to re-adopt. `InstanceNames` gives each role
("trainer-0", "engine-0") a name in one Ray namespace and looks it up again. Detached actors and groups
outlive the driver that made them, so whoever makes them detached must kill them at job end (the driver's
close stops every instance; the job's teardown stops Ray itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, PlacementGroupID

DETACHED = "detached"


@dataclass(frozen=True)
class InstanceNames:
    namespace: str  # the job's Ray namespace for catalog actors (the same for every driver of the job)
    prefix: str  # the instance's own prefix, e.g. "tiny-a-3/"
    detached: bool = False  # outlive the driver (recoverable catalogs) or die with it

    def actor(self, role: str) -> str:
        return f"{self.prefix}{role}"

    def actor_options(self, role: str) -> dict[str, Any]:
        """What `.options(...)` needs for the actor of `role`. The name must be free: a caller that respawns
        a role kills the leftover first (`kill`, as EngineCell does); a new instance's prefix is new."""
        options: dict[str, Any] = {"name": self.actor(role), "namespace": self.namespace}
        if self.detached:
            options["lifetime"] = DETACHED
        return options

    def lookup(self, role: str) -> Any | None:
        """The live actor of `role`, or None when there is none (never made, killed, or died)."""
        try:
            return ray.get_actor(self.actor(role), namespace=self.namespace)
        except ValueError:
            return None

    def kill(self, role: str) -> bool:
        """Kill the actor of `role` if it exists; whether there was one."""
        actor = self.lookup(role)
        if actor is None:
            return False
        ray.kill(actor, no_restart=True)
        return True

    def group_name(self) -> str:
        return f"{self.namespace}/{self.prefix}pg"


def find_placement_group(name: str) -> PlacementGroup | None:
    """The live (not REMOVED) placement group called `name`, in any namespace, or None.

    Ray's own `get_placement_group` looks only in the caller's namespace; the table is cluster-wide, and
    our group names carry the namespace themselves."""
    for pg_id, info in ray.util.placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
    return None
