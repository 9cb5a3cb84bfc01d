"""Why a placement group waits: bundles asked against each node's free resources."""

from __future__ import annotations

from miles.cluster.shortfall import NodeResources, bundles_that_fit, describe_shortfall

BUNDLE = {"GPU": 1, "CPU": 1}


def test_a_node_holds_as_many_bundles_as_its_scarcest_resource_allows() -> None:
    assert bundles_that_fit(BUNDLE, {"GPU": 8, "CPU": 3}) == 3
    assert bundles_that_fit(BUNDLE, {"CPU": 64}) == 0
    assert bundles_that_fit({"GPU": 1, "CPU": 0}, {"GPU": 2}) == 2  # a zero need never limits


def test_slurm_default_of_one_cpu_per_node_is_named_on_each_node() -> None:
    nodes = [
        NodeResources("10.0.0.9", {"GPU": 8, "CPU": 1}, is_head=True),
        NodeResources("10.0.0.1", {"GPU": 8, "CPU": 1}),
    ]
    message = describe_shortfall(BUNDLE, 16, nodes, nodes_expected=2)
    assert "16 bundle(s) {GPU: 1, CPU: 1} asked; Ray's free resources hold 2" in message
    assert "node 10.0.0.1 holds 1 of its 8: CPU 1 available, 8 needed" in message
    assert "node 10.0.0.9 (head) holds 1 of its 8" in message
    assert "Slurm --cpus-per-task" in message and "GPU:" not in message.split("To fix")[1]


def test_a_node_that_never_joined_is_counted() -> None:
    message = describe_shortfall(
        BUNDLE, 4, [NodeResources("10.0.0.9", {"GPU": 2, "CPU": 8})], nodes_expected=2
    )
    assert "only 1 of the job's 2 node(s) are alive in Ray" in message
    assert "10.0.0.9" not in message  # it holds its own share


def test_enough_room_says_the_wait_is_for_something_else() -> None:
    message = describe_shortfall(BUNDLE, 2, [NodeResources("a", {"GPU": 2, "CPU": 2})], nodes_expected=1)
    assert "every node has room" in message and "To fix" not in message
