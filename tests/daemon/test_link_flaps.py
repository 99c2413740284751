"""A flapping link is damped: its recoveries are held longer each time, so it cannot cause a
commit storm. Real daemons on loopback; the link is cut and restored by named faults on both
ends (``cut_link`` / ``clear``), as often as a bad radio link would."""

from __future__ import annotations

from chaos.daemon.client import DaemonClient

from tests.daemon.daemon_helpers import Cluster, Node, wait_until


def link_up(node: Node, a: str, b: str) -> bool | None:
    for lk in node.status().links:
        if {lk.a, lk.b} == {a, b}:
            return lk.up
    return None


def fault(node: Node, name: str, peers: list[str]) -> None:
    with DaemonClient(node.ipc, timeout_s=5.0) as c:
        c.fault(name, peers)  # type: ignore[arg-type]


def test_a_flapping_link_is_damped(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)  # a triangle: n1-n2, n2-n3, n3-n1
    assert link_up(n1, "n2", "n3") is True
    flaps = 4
    for i in range(flaps):
        fault(n2, "cut_link", ["n3"])
        fault(n3, "cut_link", ["n2"])
        wait_until(lambda: link_up(n1, "n2", "n3") is False, f"cut {i}: the link reported down")
        fault(n2, "clear", [])
        fault(n3, "clear", [])
        wait_until(lambda: link_up(n1, "n2", "n3") is True, f"cut {i}: the link back up",
                   timeout_s=120.0)  # fmt: skip
    events = [e for n in (n1, n2, n3) for e in n.events()]
    damped = [e for e in events if e.get("event") == "link_damped"]
    assert damped, "a link that went down four times in a row was never damped"
    downs = [e for e in events if e.get("event") == "view_installed"
             and e.get("cause") in ("disconnect_link", "connect_link")
             and e.get("node") == "n1"]  # fmt: skip
    # two commits per flap at most (down, then up), however often the members asked
    assert len(downs) <= 2 * flaps, downs
    assert all(n.alive() for n in (n1, n2, n3))
