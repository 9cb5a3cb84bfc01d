"""Role planning: nodes sorted by IP (numerically), the head last, trainers first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from miles.contract.nodes import NodeIpError, loopback_ip, node_ips, pick_by_prefix
from miles.contract.roles import Node, RoleError, parse_node_lines, plan_roles, read_roles_tsv


def nodes(*pairs: tuple[str, str]) -> list[Node]:
    return [Node(name, ip) for name, ip in pairs]


THREE = nodes(("a", "10.0.0.5"), ("b", "10.0.0.3"), ("c", "10.0.0.9"))


def order(plan) -> list[str]:
    return [p.node.name for p in plan.ordered]


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        ("b", ["a", "c", "b"]),  # head has the lowest IP
        ("c", ["b", "a", "c"]),  # head has the highest IP
        ("a", ["b", "c", "a"]),  # head in the middle
    ],
)
def test_head_is_last_and_others_sorted_by_ip(head: str, expected: list[str]) -> None:
    plan = plan_roles(THREE, head, train_nodes=1)
    assert order(plan) == expected
    assert plan.head.name == head
    assert [n.name for n in plan.trainers] == expected[:1]
    assert [n.name for n in plan.engines] == expected[1:]
    assert plan.ordered[-1].roles == ("engine", "head")


def test_ip_sort_is_numeric_not_lexical() -> None:
    ns = nodes(
        ("h", "10.0.0.1"), ("x", "10.0.0.10"), ("y", "10.0.0.9"), ("z", "10.0.0.100"), ("w", "9.9.9.9")
    )
    assert order(plan_roles(ns, "h", 2)) == ["w", "y", "x", "z", "h"]


def test_unknown_head_is_refused_with_the_node_names() -> None:
    with pytest.raises(RoleError, match=r"head 'zzz' is not one of the allocation's nodes: a, b, c"):
        plan_roles(THREE, "zzz", 1)


def test_one_node_holds_both_roles() -> None:
    plan = plan_roles(nodes(("solo", "127.0.0.2")), "solo", 1)
    assert plan.rows() == [(0, "solo", "127.0.0.2", "trainer,engine,head")]
    assert plan.trainers == plan.engines == [Node("solo", "127.0.0.2")]
    assert "head solo = ray head + driver + gateway + engine + trainer" in plan.summary_line()


def test_two_nodes_trainer_rank0_is_not_the_head() -> None:
    plan = plan_roles(nodes(("head", "10.1.0.1"), ("other", "10.1.0.2")), "head", 1)
    assert plan.rows() == [(0, "other", "10.1.0.2", "trainer"), (1, "head", "10.1.0.1", "engine,head")]
    assert plan.summary_line() == (
        "node roles: head head = ray head + driver + gateway + engine; "
        "trainers (rank 0 first): other (10.1.0.2); engines: head (10.1.0.1)"
    )


def test_ten_nodes_five_trainers() -> None:
    ns = [Node(f"n{i:02d}", f"10.2.{i // 4}.{i * 7 % 256}") for i in range(10)]
    plan = plan_roles(ns, "n04", 5)
    others = sorted((n for n in ns if n.name != "n04"), key=lambda n: tuple(map(int, n.ip.split("."))))
    assert order(plan) == [n.name for n in others] + ["n04"]
    assert [n.name for n in plan.trainers] == [n.name for n in others[:5]]
    assert len(plan.engines) == 5 and plan.engines[-1].name == "n04"


@pytest.mark.parametrize(
    ("count", "train", "message"),
    [(3, 3, "between 1 and 2"), (3, 0, "between 1 and 2"), (1, 2, "1-node job has train_nodes 1")],
)
def test_train_node_count_is_checked(count: int, train: int, message: str) -> None:
    with pytest.raises(RoleError, match=message):
        plan_roles(THREE[:count], THREE[0].name, train)


@pytest.mark.parametrize("head", ["a", "b", "c"])
def test_a_colocated_plan_makes_every_node_trainer_and_engine_head_last(head: str) -> None:
    split_order = order(plan_roles(THREE, head, 1))
    plan = plan_roles(THREE, head, 3, colocated=True)
    assert order(plan) == split_order  # the same order: trainer rank 0 first, the head last
    both, head_too = ("trainer", "engine"), ("trainer", "engine", "head")
    assert [p.roles for p in plan.ordered] == [both, both, head_too]
    assert [n.name for n in plan.trainers] == [n.name for n in plan.engines] == split_order
    assert plan.trainers[0].name != head
    line = plan.summary_line()
    assert f"head {head} = ray head + driver + gateway + engine + trainer;" in line


def test_a_colocated_plan_round_trips_through_roles_tsv(tmp_path: Path) -> None:
    plan = plan_roles(THREE, "a", 3, colocated=True)
    path = tmp_path / "roles.tsv"
    path.write_text(plan.to_tsv())
    assert path.read_text().splitlines()[1:] == [
        "0\tb\t10.0.0.3\ttrainer,engine",
        "1\tc\t10.0.0.9\ttrainer,engine",
        "2\ta\t10.0.0.5\ttrainer,engine,head",
    ]
    assert read_roles_tsv(path) == plan


@pytest.mark.parametrize("train", [1, 2, 4])
def test_a_colocated_plan_needs_every_node_training(train: int) -> None:
    with pytest.raises(
        RoleError, match=f"colocated job trains on every node: train_nodes must be 3 for 3 nodes, got {train}"
    ):
        plan_roles(THREE, "a", train, colocated=True)


def test_one_colocated_node_is_the_one_node_plan() -> None:
    solo = nodes(("solo", "127.0.0.2"))
    assert plan_roles(solo, "solo", 1, colocated=True) == plan_roles(solo, "solo", 1)


def test_launcher_roles_previews_a_colocated_plan(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("node1\nnode2\n")
    args = ["roles", "--nodefile", str(nodefile), "--head", "node1", "--ip-mode", "loopback-index", "--json"]
    result = CliRunner().invoke(main, [*args, "--train-nodes", "2", "--colocated"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["trainers"] == data["engines"] == ["node2", "node1"]
    assert data["nodes"][-1]["roles"] == ["trainer", "engine", "head"]
    split = CliRunner().invoke(main, [*args, "--train-nodes", "2"])
    assert split.exit_code == 1 and "train_nodes must be between 1 and 1" in split.output


def test_shared_ip_and_bad_ip_are_refused() -> None:
    with pytest.raises(RoleError, match=r"share IP 10\.0\.0\.1: pick another ray\.node_ip mode"):
        plan_roles(nodes(("a", "10.0.0.1"), ("b", "10.0.0.1")), "a", 1)
    with pytest.raises(RoleError, match="node a: 'not-an-ip' is not an IP address"):
        plan_roles(nodes(("a", "not-an-ip")), "a", 1)


def test_tsv_round_trip(tmp_path: Path) -> None:
    plan = plan_roles(THREE, "a", 2)
    path = tmp_path / "roles.tsv"
    path.write_text(plan.to_tsv())
    assert path.read_text().splitlines()[0] == "index\tname\tip\troles"
    assert read_roles_tsv(path) == plan


def test_node_file_collapses_pbs_slot_repeats_and_keeps_order() -> None:
    text = "n3\nn3\nn1 10.0.0.1\n\n# comment\nn2\nn1 10.0.0.1\n"
    assert parse_node_lines(text) == [("n3", None), ("n1", "10.0.0.1"), ("n2", None)]
    with pytest.raises(RoleError, match="line 1"):
        parse_node_lines("a b c\n")


def test_loopback_index_mode_maps_allocation_order() -> None:
    entries = node_ips([("node1", None), ("node2", None), ("node3", "10.9.9.9")], "loopback-index")
    assert entries == [("node1", "127.0.0.2"), ("node2", "127.0.0.3"), ("node3", "10.9.9.9")]
    with pytest.raises(NodeIpError, match="at most 253"):
        loopback_ip(253)


def test_hostname_and_remote_modes() -> None:
    assert node_ips([("x", None)], "hostname", resolve=lambda n: "10.3.3.3") == [("x", "10.3.3.3")]
    with pytest.raises(NodeIpError, match="needs the IP in the node file"):
        node_ips([("x", None)], "prefix")
    assert pick_by_prefix(["192.168.1.4", "10.1.0.20", "10.1.0.3"], "10.1.") == "10.1.0.3"
    with pytest.raises(NodeIpError, match=r"starts with '172\.'"):
        pick_by_prefix(["10.1.0.3"], "172.")


def test_roles_cli_writes_tsv_and_prints_summary_or_json(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("node1\nnode1\nnode2\nnode3\n")  # PBS_NODEFILE style
    tsv = tmp_path / "roles.tsv"
    args = ["roles", "--nodefile", str(nodefile), "--head", "node1", "--train-nodes", "1"]
    result = CliRunner().invoke(main, [*args, "--ip-mode", "loopback-index", "--tsv", str(tsv)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("node roles: head node1 = ray head")
    assert [r.node.name for r in read_roles_tsv(tsv).ordered] == ["node2", "node3", "node1"]
    result = CliRunner().invoke(main, [*args, "--ip-mode", "loopback-index", "--json"])
    data = json.loads(result.output)
    assert data["trainers"] == ["node2"] and data["engines"] == ["node3", "node1"]
    assert data["nodes"][-1] == {"index": 2, "name": "node1", "ip": "127.0.0.2", "roles": ["engine", "head"]}


def test_roles_cli_errors_exit_non_zero(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("node1\nnode2\n")
    base = ["roles", "--nodefile", str(nodefile), "--ip-mode", "loopback-index"]
    result = CliRunner().invoke(main, [*base, "--head", "nodeX", "--train-nodes", "1"])
    assert result.exit_code == 1 and "head 'nodeX' is not one of" in result.output
    result = CliRunner().invoke(main, [*base, "--head", "node1", "--train-nodes", "2"])
    assert result.exit_code == 1 and "train_nodes must be between 1 and 1" in result.output


# ---- pinned by the planning mutation run (docs/testing.md, "Mutation testing") ----------------------------


def test_the_json_plan_names_the_head_and_carries_the_summary() -> None:
    plan = plan_roles(THREE, "a", 1)
    data = plan.to_json()
    assert data["head"] == {"name": "a", "ip": "10.0.0.5"}
    assert data["summary"] == plan.summary_line()
    assert data["summary"].endswith("engines: c (10.0.0.9), a (10.0.0.5)")  # every engine, in role order


def test_empty_and_repeated_node_lists_are_refused_naming_the_problem() -> None:
    with pytest.raises(RoleError, match=r"the allocation has no nodes \(empty node list\)"):
        plan_roles([], "a", 1)
    with pytest.raises(RoleError, match="node names repeat in the node list: a, b, a"):
        plan_roles(nodes(("a", "10.0.0.1"), ("b", "10.0.0.2"), ("a", "10.0.0.3")), "a", 1)


def test_a_shared_ip_names_both_nodes_that_share_it() -> None:
    with pytest.raises(RoleError, match=r"nodes b and c share IP 10\.0\.0\.2"):
        plan_roles(nodes(("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.2")), "a", 1)


def test_a_node_file_comment_starts_at_the_first_hash() -> None:
    assert parse_node_lines("n1 10.0.0.1 # rack 4 # spare\n") == [("n1", "10.0.0.1")]


def test_a_node_listed_with_two_ips_is_refused_but_a_repeat_without_ip_is_not() -> None:
    with pytest.raises(RoleError, match="node file line 2: n1 listed with two IPs"):
        parse_node_lines("n1 10.0.0.1\nn1 10.0.0.2\n")
    assert parse_node_lines("n1 10.0.0.1\nn1\n") == [("n1", "10.0.0.1")]  # a PBS slot line adds no IP


@pytest.mark.parametrize(
    "text",
    [
        "",  # empty
        "name\tip\troles\n",  # another header
        "index name ip roles\n0 a 10.0.0.1 trainer,engine,head\n",  # spaces, not tabs
    ],
)
def test_a_file_that_is_not_a_roles_tsv_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "roles.tsv"
    path.write_text(text)
    with pytest.raises(RoleError, match=r"not a roles\.tsv \(header .* expected\)"):
        read_roles_tsv(path)
