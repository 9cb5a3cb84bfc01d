"""The device pool: the job's nodes and their free GPUs, head last. Pure bookkeeping, no I/O."""

from __future__ import annotations

from collections.abc import Iterable

from miles.contract.catalog import PoolNode


class PoolError(RuntimeError):
    """A claim or free that does not match the pool's books: a bug in the caller."""


def ordered_head_last(nodes: Iterable[PoolNode]) -> list[PoolNode]:
    """Workers by IP-ish name first, the head last, as today's placement orders bundles."""
    return sorted(nodes, key=lambda n: (n.is_head, n.node))


class DevicePool:
    def __init__(self, nodes: Iterable[PoolNode]) -> None:
        self.nodes = ordered_head_last(nodes)
        names = [n.node for n in self.nodes]
        if len(set(names)) != len(names):
            raise PoolError(f"pool nodes repeat: {names}")
        self._capacity = {n.node: n.gpus for n in self.nodes}
        self._free = dict(self._capacity)

    def free_by_node(self) -> dict[str, int]:
        return {name: self._free[name] for name in self._capacity}

    def free_total(self) -> int:
        return sum(self._free.values())

    def capacity_total(self) -> int:
        return sum(self._capacity.values())

    def find_node(self, gpus: int) -> str | None:
        """The first node (head last) with `gpus` free, or None: first fit keeps the head free longest."""
        return next((name for name, free in self._free.items() if free >= gpus), None)

    def claim(self, node: str, gpus: int) -> None:
        if node not in self._free:
            raise PoolError(f"node {node} is not in the pool ({', '.join(self._free)})")
        if gpus < 1 or self._free[node] < gpus:
            raise PoolError(f"cannot claim {gpus} GPU(s) on {node}: {self._free[node]} free")
        self._free[node] -= gpus

    def free(self, node: str, gpus: int) -> None:
        if node not in self._free or self._free[node] + gpus > self._capacity[node]:
            raise PoolError(f"cannot free {gpus} GPU(s) on {node}: more than it has")
        self._free[node] += gpus
