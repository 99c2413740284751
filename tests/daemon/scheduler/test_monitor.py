"""The cluster monitor's membership cache follows every change of a node's presence or state."""

from __future__ import annotations

from chaos.daemon.scheduler.monitor import ClusterMonitor

from chaos.protocol.states import NodeState


def test_members_follow_adds_removals_and_state_changes() -> None:
    m = ClusterMonitor()
    m.add_node("b", "tcp://127.0.0.1:2", NodeState.ACTIVE, 0.0)
    m.add_node("a", "tcp://127.0.0.1:1", NodeState.ACTIVE, 0.0)
    m.add_node("j", "tcp://127.0.0.1:3", NodeState.JOINING, 0.0)
    v0 = m.version
    assert m.members() == ["a", "b"]
    assert m.members((NodeState.ACTIVE, NodeState.JOINING)) == ["a", "b", "j"]
    got = m.members()
    got.append("zz")  # a caller's copy: the cache is not aliased
    assert m.members() == ["a", "b"]
    m.set_state("j", NodeState.ACTIVE)
    assert m.members() == ["a", "b", "j"] and m.version > v0
    m.set_state("b", NodeState.LEAVING)
    assert m.members() == ["a", "j"]
    m.remove_node("b")
    assert m.members((NodeState.ACTIVE, NodeState.LEAVING)) == ["a", "j"]
    m.add_node("a", "tcp://127.0.0.1:9", NodeState.JOINING, 1.0)  # re-added in another state
    assert m.members() == ["j"]
    v = m.version
    m.set_state("j", NodeState.ACTIVE)  # no change: no new version
    assert m.version == v


def test_view_lists_each_nodes_up_neighbours() -> None:
    m = ClusterMonitor()
    for n in "abcd":
        m.add_node(n, f"tcp://127.0.0.1:{ord(n)}", NodeState.ACTIVE, 0.0)
    m.set_link("a", "b")
    m.set_link("c", "a")
    m.set_link("b", "c", up=False)
    m.set_link("d", "c")
    view = m.to_view(3, 1, "a")
    nbrs = {n.id: n.neighbors for n in view.nodes}
    assert nbrs == {"a": ["b", "c"], "b": ["a"], "c": ["a", "d"], "d": ["c"]}
    assert nbrs == {n: m.neighbors(n) for n in "abcd"}
    assert [(x.a, x.b, x.up) for x in view.links] == [
        ("a", "b", True), ("a", "c", True), ("b", "c", False), ("c", "d", True)
    ]
