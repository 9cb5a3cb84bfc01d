"""Role planning: the allocation's nodes and the head -> ordered roles, the head last.

Nodes are sorted by IP with the head moved to the end; trainers take the first `train_nodes`, engines
the rest. The head runs Ray's head, the driver and the gateway, so it never also hosts trainer rank 0
(unless the job has a single node, which then holds both roles). A colocated job (`colocate.enabled`)
plans every node as trainer and engine, in the same order: trainer rank 0 is still the first node, the
head still last (the last trainer rank). This is the one planner: the job script
gets its roles from here (`python -m miles.job.roles` writes roles.tsv; `launcher roles` previews a
plan), and the driver reads that roles.tsv (`MILES_ROLES_FILE`) to order its placement bundles, or plans
with these same functions when started without one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TSV_HEADER = ("index", "name", "ip", "roles")
HEAD_DUTIES = "ray head + driver + gateway + engine"


class RoleError(ValueError):
    """The nodes, head or trainer count cannot form a valid role plan."""


@dataclass(frozen=True)
class Node:
    name: str
    ip: str


@dataclass(frozen=True)
class PlannedNode:
    index: int  # position in role order: trainer rank for trainers
    node: Node
    roles: tuple[str, ...]  # subset of ("trainer", "engine", "head"), in that order


@dataclass(frozen=True)
class RolePlan:
    head: Node
    ordered: tuple[PlannedNode, ...]

    @property
    def trainers(self) -> list[Node]:
        return [p.node for p in self.ordered if "trainer" in p.roles]

    @property
    def engines(self) -> list[Node]:
        return [p.node for p in self.ordered if "engine" in p.roles]

    def rows(self) -> list[tuple[int, str, str, str]]:
        """roles.tsv rows in role order: (index, name, ip, comma-separated roles)."""
        return [(p.index, p.node.name, p.node.ip, ",".join(p.roles)) for p in self.ordered]

    def to_tsv(self) -> str:
        lines = ["\t".join(TSV_HEADER)] + ["\t".join(map(str, row)) for row in self.rows()]
        return "\n".join(lines) + "\n"

    def positions(self) -> dict[str, int]:
        """Node IP -> its place in role order (the order the driver sorts placement bundles by)."""
        return {p.node.ip: place for place, p in enumerate(self.ordered)}

    def summary_line(self) -> str:
        head_roles = next(p.roles for p in self.ordered if p.node == self.head)
        duties = HEAD_DUTIES + (" + trainer" if "trainer" in head_roles else "")
        return (
            f"node roles: head {self.head.name} = {duties}; "
            f"trainers (rank 0 first): {_names(self.trainers)}; engines: {_names(self.engines)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "head": {"name": self.head.name, "ip": self.head.ip},
            "nodes": [
                {"index": i, "name": name, "ip": ip, "roles": roles.split(",")}
                for i, name, ip, roles in self.rows()
            ],
            "trainers": [n.name for n in self.trainers],
            "engines": [n.name for n in self.engines],
            "summary": self.summary_line(),
        }


def _names(nodes: Sequence[Node]) -> str:
    return ", ".join(f"{n.name} ({n.ip})" for n in nodes)


def _ip_key(node: Node) -> tuple[int, int]:
    address = ipaddress.ip_address(node.ip)
    return (address.version, int(address))


def plan_roles(nodes: Sequence[Node], head: str, train_nodes: int, colocated: bool = False) -> RolePlan:
    """Order nodes by IP (numerically), the head last; the first `train_nodes` train, the rest serve.
    `colocated`: every node trains and serves (train_nodes must be every node)."""
    _validate(nodes, head, train_nodes, colocated)
    head_node = next(n for n in nodes if n.name == head)
    order = [*sorted((n for n in nodes if n.name != head), key=_ip_key), head_node]
    planned = []
    for index, node in enumerate(order):
        roles = []
        if index < train_nodes:
            roles.append("trainer")
        if index >= train_nodes or len(order) == 1 or colocated:
            roles.append("engine")
        if node is head_node:
            roles.append("head")
        planned.append(PlannedNode(index, node, tuple(roles)))
    return RolePlan(head_node, tuple(planned))


def plan_from_ips(ips: Sequence[str], head_ip: str, train_nodes: int, colocated: bool = False) -> RolePlan:
    """The same plan for nodes known only by IP (a driver started without the job's roles.tsv)."""
    return plan_roles([Node(ip, ip) for ip in ips], head_ip, train_nodes, colocated)


def _validate(nodes: Sequence[Node], head: str, train_nodes: int, colocated: bool = False) -> None:
    if not nodes:
        raise RoleError("the allocation has no nodes (empty node list)")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise RoleError(f"node names repeat in the node list: {', '.join(names)}")
    for node in nodes:
        try:
            ipaddress.ip_address(node.ip)
        except ValueError:
            raise RoleError(f"node {node.name}: {node.ip!r} is not an IP address") from None
    seen: dict[str, str] = {}
    for node in nodes:
        if node.ip in seen:
            raise RoleError(
                f"nodes {seen[node.ip]} and {node.name} share IP {node.ip}: pick another ray.node_ip mode "
                "(interface or prefix on real clusters; loopback-index when all nodes share one host)"
            )
        seen[node.ip] = node.name
    if head not in names:
        raise RoleError(f"head {head!r} is not one of the allocation's nodes: {', '.join(names)}")
    if len(nodes) == 1 and train_nodes != 1:
        raise RoleError(f"a 1-node job has train_nodes 1 (the node holds both roles), got {train_nodes}")
    if colocated and train_nodes != len(nodes):
        raise RoleError(
            f"a colocated job trains on every node: train_nodes must be {len(nodes)} for {len(nodes)} nodes, "
            f"got {train_nodes}"
        )
    if len(nodes) > 1 and not colocated and not 1 <= train_nodes < len(nodes):
        raise RoleError(
            f"train_nodes must be between 1 and {len(nodes) - 1} for {len(nodes)} nodes "
            f"(the head always serves engines), got {train_nodes}"
        )


def parse_node_lines(text: str) -> list[tuple[str, str | None]]:
    """Parse a node file: one `NAME` or `NAME IP` per line; repeats (PBS slots) collapse, order kept."""
    entries: dict[str, str | None] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise RoleError(f"node file line {number}: expected 'NAME' or 'NAME IP', got {line!r}")
        name, ip = fields[0], (fields[1] if len(fields) == 2 else None)
        if name in entries and entries[name] != ip and ip is not None:
            raise RoleError(f"node file line {number}: {name} listed with two IPs")
        entries.setdefault(name, ip)
    return list(entries.items())


def read_roles_tsv(path: Path) -> RolePlan:
    """Read back a roles.tsv written by `RolePlan.to_tsv` (for the runtime and for tests)."""
    lines = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    if not lines or tuple(lines[0]) != TSV_HEADER:
        raise RoleError(f"{path}: not a roles.tsv (header {TSV_HEADER} expected)")
    ordered = tuple(
        PlannedNode(int(index), Node(name, ip), tuple(roles.split(",")))
        for index, name, ip, roles in lines[1:]
    )
    head = next(p.node for p in ordered if "head" in p.roles)
    return RolePlan(head, ordered)


def plan_from_node_file(
    text: str, head: str, train_nodes: int, ip_mode: str, colocated: bool = False
) -> RolePlan:
    """The plan for a node file ('NAME' or 'NAME IP' per line; PBS_NODEFILE's repeats collapse), the IPs it
    lacks chosen as `ip_mode` says (`miles.contract.nodes.node_ips`)."""
    from miles.contract.nodes import node_ips

    entries = node_ips(parse_node_lines(text), ip_mode)
    return plan_roles([Node(name, ip) for name, ip in entries], head, train_nodes, colocated)
