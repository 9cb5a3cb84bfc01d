"""Fixtures of the catalog's tests: a settable clock and a two-node pool."""

from __future__ import annotations

import pytest

from miles.contract.catalog import PoolNode
from tests.fast.catalog.memory_backend import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def two_nodes() -> list[PoolNode]:
    """Two 4-GPU nodes, the head listed first (the pool must still put it last)."""
    return [PoolNode("10.0.0.9", 4, is_head=True), PoolNode("10.0.0.2", 4)]
