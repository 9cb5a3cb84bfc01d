"""When a push may reuse the group the last push kept (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.weights.kept_group import KeptGroup, member_ids, reusable
from miles.weights.sender import GroupSpec


@dataclass
class Cell:
    starts: int = 1
    client: object = field(default_factory=object)


def kept(cells: list[Cell], backend: str = "gloo") -> KeptGroup:
    spec = GroupSpec("10.0.0.1", 29500, 1 + len(cells), "miles-push-v1-abc", backend=backend)
    return KeptGroup(spec, member_ids(cells))


def test_the_same_processes_reuse_the_group() -> None:
    cells = [Cell(), Cell()]
    assert reusable(kept(cells), member_ids(cells), "gloo", "miles-push-v1-abc")


def test_any_other_membership_gets_a_fresh_group() -> None:
    cells = [Cell(), Cell()]
    group = kept(cells)
    assert not reusable(None, member_ids(cells), "gloo", None)
    assert not reusable(group, member_ids(cells[::-1]), "gloo", "miles-push-v1-abc")  # ranks moved
    assert not reusable(group, member_ids(cells[:1]), "gloo", "miles-push-v1-abc")  # one left routing
    assert not reusable(group, member_ids(cells), "nccl", "miles-push-v1-abc")
    assert not reusable(group, member_ids(cells), "gloo", None)  # the trainer restarted
    assert not reusable(group, member_ids(cells), "gloo", "miles-push-v7-def")  # another trainer's group
    cells[1].starts += 1  # respawned: a new engine process that never joined
    cells[1].client = object()
    assert not reusable(group, member_ids(cells), "gloo", "miles-push-v1-abc")
