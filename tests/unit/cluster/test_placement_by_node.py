"""ray_cluster.by_node: a placement group's bundles, wherever Ray put them, become devices node by node, so
megatron's rank order (tensor parallel fastest) keeps a tensor-parallel group on one node; and
trainer/group.interface_of, which gloo binds to."""

from __future__ import annotations

from rlbridge.cluster.ray_cluster import by_node
from rlbridge.trainer.group import interface_of


def test_interleaved_bundles_become_devices_node_by_node() -> None:
    slots, order, node_of_slot = by_node(["b", "a", "b", "a"])
    assert order == ["b", "a"]  # bundle 0's node first: a colocated rollout shares it with rank 0
    assert slots == [0, 2, 1, 3] and node_of_slot == [0, 0, 1, 1]


def test_one_node_keeps_the_bundle_order() -> None:
    assert by_node(["a", "a", "a"]) == ([0, 1, 2], ["a"], [0, 0, 0])


def test_interface_of_loopback_and_of_an_address_nobody_has() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None
