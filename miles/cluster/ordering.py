"""Pure ordering of placement-group bundles and the split into trainer and engine bundles.

Order = (head last, node IP numerically, GPU id): trainers take the first bundles, engines the rest, so the
head node (which also runs the driver, the gateway and Ray's control plane) never trains unless the job
has a single node.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BundleLocation:
    """Where one bundle of a placement group landed, as its InfoActor reported it."""

    bundle_index: int
    node_ip: str
    gpu_id: int
    node_id: str = ""


def ip_sort_key(address: str) -> tuple[int, tuple[int, ...] | str]:
    """IPv4/IPv6 addresses sort numerically (10.0.0.9 before 10.0.0.10); anything else after, by text."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (1, address)
    return (0, (ip.version, int(ip)))


def sort_bundles_head_last(bundles: Sequence[BundleLocation], head_ip: str | None) -> list[BundleLocation]:
    """Bundles ordered by (on the head node last, node IP, GPU id); `head_ip=None` = head unknown."""

    def key(bundle: BundleLocation) -> tuple:
        on_head = head_ip is not None and bundle.node_ip == head_ip
        return (on_head, ip_sort_key(bundle.node_ip), bundle.node_id, bundle.gpu_id)

    return sorted(bundles, key=key)


@dataclass(frozen=True)
class RoleBundles:
    trainer: list[BundleLocation]
    engines: list[list[BundleLocation]]  # one list per engine, `gpus_per_engine` bundles on one node


def allocate_roles(
    ordered: Sequence[BundleLocation], *, trainer_gpus: int, gpus_per_engine: int = 1
) -> RoleBundles:
    """Trainers take the first `trainer_gpus` bundles; the rest make engines of `gpus_per_engine` each."""
    if trainer_gpus < 0 or gpus_per_engine < 1:
        raise ValueError(
            f"trainer_gpus must be >= 0 and gpus_per_engine >= 1 (got {trainer_gpus}, {gpus_per_engine})"
        )
    if trainer_gpus > len(ordered):
        raise ValueError(f"{trainer_gpus} trainer GPUs requested but the placement group has {len(ordered)}")
    rest = list(ordered[trainer_gpus:])
    if len(rest) % gpus_per_engine:
        raise ValueError(
            f"{len(rest)} GPUs are left for engines, not a multiple of gpus_per_engine={gpus_per_engine}; "
            "change the GPU counts so the engines divide them evenly"
        )
    engines = [rest[i : i + gpus_per_engine] for i in range(0, len(rest), gpus_per_engine)]
    for index, group in enumerate(engines):
        nodes = {b.node_id or b.node_ip for b in group}
        if len(nodes) > 1:
            raise ValueError(
                f"engine {index} would span nodes {sorted(nodes)}; an engine's GPUs must be on one node "
                "(pick gpus_per_engine that divides the GPUs per node)"
            )
    return RoleBundles(trainer=list(ordered[:trainer_gpus]), engines=engines)
