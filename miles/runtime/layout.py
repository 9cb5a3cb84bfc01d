"""Pure: the job's role plan, and which placement-group bundles train and which serve under it.

The plan is the roles.tsv the job script wrote (`MILES_ROLES_FILE`, made by `miles.contract.roles`): one
planner, one source of truth. A driver started without one (tests, demos) plans with the same function
over Ray's nodes. Bundles arrive in plan order (head last, then GPU id). Multi-node: the plan's trainer
nodes' bundles all train; every engine node gives `engines_per_node` engines of `tp_size` bundles each
(its first ones). One node: the engines take the node's last `engines_per_node * tp_size` bundles and
the trainer the rest. Colocated jobs use `colocated_layout` instead: every bundle does both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.cluster.ordering import BundleLocation
from miles.contract.roles import RoleError, RolePlan, plan_from_ips, read_roles_tsv


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    trainer: list[BundleLocation]
    engines: list[list[BundleLocation]]


def driver_role_plan(
    node_ips: Sequence[str],
    head_ip: str | None,
    train_nodes: int,
    roles_file: Path | None,
    *,
    colocated: bool = False,
) -> RolePlan:
    """The job's role plan: its roles.tsv when there is one, else the same planner over Ray's nodes."""
    if roles_file is not None:
        try:
            plan = read_roles_tsv(roles_file)
        except (OSError, RoleError) as exc:
            raise LayoutError(f"cannot read the job's role plan {roles_file}: {exc}") from None
        unknown = sorted(set(node_ips) - plan.positions().keys())
        if unknown:
            raise LayoutError(f"Ray nodes {', '.join(unknown)} are not in the job's role plan {roles_file}")
        return plan
    if not head_ip:
        raise LayoutError("the Ray head's node IP is unknown, so no role plan can put it last")
    try:
        nodes = len(set(node_ips))
        return plan_from_ips(sorted(set(node_ips)), head_ip, train_nodes if nodes > 1 else 1, colocated)
    except RoleError as exc:
        raise LayoutError(f"no role plan for Ray's nodes: {exc}") from None


def _by_node(ordered: Sequence[BundleLocation]) -> list[list[BundleLocation]]:
    nodes: list[list[BundleLocation]] = []
    for bundle in ordered:
        key = bundle.node_id or bundle.node_ip
        if nodes and (nodes[-1][0].node_id or nodes[-1][0].node_ip) == key:
            nodes[-1].append(bundle)
        else:
            nodes.append([bundle])
    return nodes


def colocated_layout(ordered: Sequence[BundleLocation], *, tp_size: int) -> Layout:
    """Colocated (docs/colocation.md): every bundle trains and serves. Trainer rank i and engine i share
    bundle i, so rank i's weights reach engine i over IPC; an engine of `tp_size` GPUs spans the bundles of
    ranks i*tp_size.. on one node."""
    engines: list[list[BundleLocation]] = []
    for node in _by_node(ordered):
        if len(node) % tp_size:
            raise LayoutError(
                f"node {node[0].node_ip} has {len(node)} GPUs, not a multiple of engines.tp_size {tp_size}"
            )
        engines += [node[i : i + tp_size] for i in range(0, len(node), tp_size)]
    return Layout(trainer=list(ordered), engines=engines)


def plan_layout(
    ordered: Sequence[BundleLocation], *, plan: RolePlan, engines_per_node: int, tp_size: int
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
    trainer_ips = {node.ip for node in plan.trainers}
    trainer = [b for node in nodes if node[0].node_ip in trainer_ips for b in node]
    if not trainer:
        raise LayoutError(f"no bundle landed on the plan's trainer nodes ({', '.join(sorted(trainer_ips))})")
    engines: list[list[BundleLocation]] = []
    for node in nodes:
        if node[0].node_ip in trainer_ips:
            continue
        if len(node) < per_engine_node:
            raise LayoutError(
                f"node {node[0].node_ip} has {len(node)} GPUs; {engines_per_node} engine(s) of "
                f"{tp_size} GPU(s) need {per_engine_node}"
            )
        engines += [node[i : i + tp_size] for i in range(0, per_engine_node, tp_size)]
    return Layout(trainer=trainer, engines=engines)
