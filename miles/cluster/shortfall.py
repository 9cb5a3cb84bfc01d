"""Why a placement group is not ready: the bundles asked for against what each Ray node has free.

Pure: the caller reads the nodes' resources from Ray. The message names the missing resources and the
nodes that lack them, and the preset/scheduler setting that gives a node more of each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What to change when a node lacks a resource (CPU: Ray sees what the scheduler step gave it).
RESOURCE_FIX = {
    "CPU": "ray.num_cpus, or the CPUs the scheduler gives each node (Slurm --cpus-per-task, PBS ncpus)",
    "GPU": "gpus_per_node, and the GPUs the scheduler gives each node",
}


@dataclass(frozen=True)
class NodeResources:
    ip: str
    available: Mapping[str, float]
    is_head: bool = False


def bundles_that_fit(bundle: Mapping[str, float], available: Mapping[str, float]) -> int:
    """How many copies of `bundle` a node with `available` resources can hold."""
    counts = [math.floor(available.get(name, 0.0) / need + 1e-9) for name, need in bundle.items() if need > 0]
    return min(counts) if counts else 0


def _node_lacks(bundle: Mapping[str, float], node: NodeResources, wanted: int) -> dict[str, str]:
    """Resource name -> "have available, need needed" for each resource short of `wanted` bundles."""
    lacks = {}
    for name, need in bundle.items():
        have = node.available.get(name, 0.0)
        if need > 0 and have + 1e-9 < need * wanted:
            lacks[name] = f"{name} {have:g} available, {need * wanted:g} needed"
    return lacks


def describe_shortfall(
    bundle: Mapping[str, float],
    count: int,
    nodes: Sequence[NodeResources],
    *,
    nodes_expected: int | None = None,
    single_node: bool = False,
) -> str:
    """One paragraph: how many of `count` bundles fit, and which node lacks what."""
    per_node = count if single_node or not nodes_expected else math.ceil(count / nodes_expected)
    shown = ", ".join(f"{k}: {v:g}" for k, v in bundle.items())
    fits = {node.ip: bundles_that_fit(bundle, node.available) for node in nodes}
    parts = [f"{count} bundle(s) {{{shown}}} asked; Ray's free resources hold {sum(fits.values())}"]
    if nodes_expected is not None and len(nodes) < nodes_expected:
        parts.append(f"only {len(nodes)} of the job's {nodes_expected} node(s) are alive in Ray")
    missing: set[str] = set()
    for node in sorted(nodes, key=lambda n: n.ip):
        lacks = _node_lacks(bundle, node, per_node)
        if not lacks or fits[node.ip] >= per_node:
            continue
        missing.update(lacks)
        head = " (head)" if node.is_head else ""
        parts.append(
            f"node {node.ip}{head} holds {fits[node.ip]} of its {per_node}: {', '.join(lacks.values())}"
        )
    if len(parts) == 1:
        parts.append("every node has room: the group waits for something else (see `ray status`)")
    fixes = [f"{name}: {RESOURCE_FIX[name]}" for name in sorted(missing) if name in RESOURCE_FIX]
    return "; ".join(parts) + (f". To fix, raise {' / '.join(fixes)}" if fixes else "")
