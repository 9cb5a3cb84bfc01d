"""Pure: which placement-group bundles train and which serve, from the preset's shape.

Bundles arrive ordered (head last, node IP, GPU id). Multi-node: the first `train_nodes` nodes' bundles all
train; every other node gives `engines_per_node` engines of `tp_size` bundles each (its first ones). One
node: the engines take the node's last `engines_per_node * tp_size` bundles and the trainer the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.cluster.ordering import BundleLocation


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    trainer: list[BundleLocation]
    engines: list[list[BundleLocation]]


def _by_node(ordered: Sequence[BundleLocation]) -> list[list[BundleLocation]]:
    nodes: list[list[BundleLocation]] = []
    for bundle in ordered:
        key = bundle.node_id or bundle.node_ip
        if nodes and (nodes[-1][0].node_id or nodes[-1][0].node_ip) == key:
            nodes[-1].append(bundle)
        else:
            nodes.append([bundle])
    return nodes


def plan_layout(
    ordered: Sequence[BundleLocation], *, train_nodes: int, engines_per_node: int, tp_size: int
) -> Layout:
    nodes = _by_node(ordered)
    per_engine_node = engines_per_node * tp_size
    if len(nodes) == 1:
        bundles = nodes[0]
        trainer_count = len(bundles) - per_engine_node
        if trainer_count < 1:
            raise LayoutError(
                f"one node with {len(bundles)} GPUs cannot hold {engines_per_node} engine(s) of "
                f"{tp_size} GPU(s) and a trainer; raise gpus_per_node or lower engines.per_node"
            )
        rest = bundles[trainer_count:]
        engines = [rest[i : i + tp_size] for i in range(0, len(rest), tp_size)]
        return Layout(trainer=list(bundles[:trainer_count]), engines=engines)
    if not 1 <= train_nodes < len(nodes):
        raise LayoutError(
            f"train_nodes={train_nodes} must be between 1 and {len(nodes) - 1} for {len(nodes)} nodes"
        )
    trainer = [b for node in nodes[:train_nodes] for b in node]
    engines: list[list[BundleLocation]] = []
    for node in nodes[train_nodes:]:
        if len(node) < per_engine_node:
            raise LayoutError(
                f"node {node[0].node_ip} has {len(node)} GPUs; {engines_per_node} engine(s) of "
                f"{tp_size} GPU(s) need {per_engine_node}"
            )
        engines += [node[i : i + tp_size] for i in range(0, per_engine_node, tp_size)]
    return Layout(trainer=trainer, engines=engines)
