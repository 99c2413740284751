"""Multi-process control-plane tests: real daemons on loopback (behaviour only, no timing)."""

from __future__ import annotations

import signal

from daemon_helpers import Cluster, Node, scheduler_of, wait_until


def _agree(nodes: list[Node]) -> str | None:
    """The common scheduler if every node follows the same one and none pauses."""
    sts = [n.status() for n in nodes]
    scheds = {s.scheduler for s in sts}
    if len(scheds) == 1 and None not in scheds and not any(s.paused for s in sts):
        return sts[0].scheduler
    return None


def _link(node: Node, a: str, b: str) -> dict[str, object] | None:
    for x in node.status().links:
        if {x.a, x.b} == {a, b}:
            return {"up": x.up, "bandwidth_bps": x.bandwidth_bps, "latency_s": x.latency_s}
    return None


def test_five_daemons_form_a_cluster_with_one_scheduler(cluster: Cluster) -> None:
    nodes = cluster.start(5)
    sched = wait_until(lambda: _agree(nodes), "one scheduler")
    assert sched == "n1"  # the founder, nobody failed
    st = nodes[0].status()
    assert [n.state for n in st.nodes] == ["active"] * 5
    epochs = {n.status().epoch for n in nodes}
    assert len(epochs) == 1
    # the joins measured their links (latency and bandwidth); without a registered trainer no
    # node takes part in training, so the sync policy is empty
    assert all(x.latency_s is not None and x.bandwidth_bps for x in st.links)
    assert st.sync is not None and st.sync.nodes == []
    assert all(n.trainer == "none" for n in st.nodes)


def test_join_through_a_non_scheduler_and_leave(cluster: Cluster) -> None:
    nodes = cluster.start(3)
    joiner = cluster.spawn("j", join=nodes[2], neighbors=("n2",))  # forwarded to n1
    all_ids = {"n1", "n2", "n3", "j"}
    wait_until(lambda: all(cluster.members(n) == all_ids for n in [*nodes, joiner]), "join seen")
    assert _link(nodes[0], "j", "n2") is not None
    st = joiner.status()
    assert st.scheduler == "n1" and st.state == "active"

    res = cluster.cli(joiner, "leave")
    assert res.returncode == 0, res.stderr
    assert "leave: ok" in res.stdout
    assert joiner.proc.wait(timeout=10) == 0
    wait_until(lambda: all(cluster.members(n) == {"n1", "n2", "n3"} for n in nodes), "leave seen")
    causes = [e.get("cause") for e in nodes[0].events() if e["event"] == "committed"]
    assert "scale_in_leave" in causes and "scale_out" in causes


def test_sigterm_leaves_gracefully(cluster: Cluster) -> None:
    nodes = cluster.start(3)
    nodes[2].proc.send_signal(signal.SIGTERM)
    assert nodes[2].proc.wait(timeout=15) == 0
    wait_until(lambda: cluster.members(nodes[0]) == {"n1", "n2"}, "scale-in after SIGTERM")
    assert not any(e["event"] == "node_failed" for e in nodes[0].events())
    # the scheduler leaves: it hands over, and the last node can leave too
    nodes[0].proc.send_signal(signal.SIGTERM)
    assert nodes[0].proc.wait(timeout=15) == 0
    wait_until(lambda: nodes[1].status().role == "scheduler", "n2 takes over")
    assert cluster.members(nodes[1]) == {"n2"}
    nodes[1].proc.send_signal(signal.SIGTERM)
    assert nodes[1].proc.wait(timeout=15) == 0
    assert not any(e["event"] == "handler_error" for n in nodes for e in n.events())


def test_everyone_leaving_at_once_completes_every_leave(cluster: Cluster) -> None:
    """SIGTERM to all members at once (the end of a run): each leave is acknowledged.

    A leaver stops acknowledging views, so the scheduler must not wait for it; each daemon's
    ``left`` event says ok instead of a timeout.
    """
    nodes = cluster.start(3)
    wait_until(lambda: _agree(nodes), "one scheduler")
    for n in nodes:
        n.proc.send_signal(signal.SIGTERM)
    for n in nodes:
        assert n.proc.wait(timeout=15) == 0
    for n in nodes:
        left = [e for e in n.events() if e["event"] == "left"]
        assert len(left) == 1 and left[0]["ok"] is True, (n.id, left)


def test_kill9_member_is_removed_by_every_survivor(cluster: Cluster) -> None:
    nodes = cluster.start(4)
    cluster.kill9(nodes[2])
    survivors = [n for n in nodes if n.id != "n3"]
    wait_until(lambda: all("n3" not in cluster.members(n) for n in survivors), "n3 gone")
    ev = [e for e in nodes[0].events() if e["event"] == "node_failed"]
    assert [e["peer"] for e in ev] == ["n3"]
    committed = [e for e in nodes[0].events() if e["event"] == "committed"]
    assert committed[-1]["cause"] == "scale_in_failure"
    assert committed[-1]["restart_allreduce"] is True
    assert committed[-1]["apply_at"] == "before_next_allreduce"


def test_kill9_scheduler_reelects_and_everyone_follows(cluster: Cluster) -> None:
    nodes = cluster.start(5)
    old_term = nodes[1].status().term
    cluster.kill9(nodes[0])
    survivors = nodes[1:]
    new = wait_until(
        lambda: _agree(survivors) not in (None, "n1") and _agree(survivors),
        "a new scheduler everyone follows",
    )
    assert new != "n1"
    wait_until(lambda: all("n1" not in cluster.members(n) for n in survivors), "n1 removed")
    assert all(n.status().term > old_term for n in survivors)
    sched = next(n for n in survivors if n.id == new)
    assert sched.status().role == "scheduler"
    assert sum(n.status().role == "scheduler" for n in survivors) == 1
    # the new scheduler works: a link change goes through it
    res = cluster.cli(survivors[-1], "link", "add", "n2")
    assert res.returncode == 0, res.stderr


def test_link_add_and_remove(cluster: Cluster) -> None:
    nodes = cluster.start(4)
    n2, n4 = nodes[1], nodes[3]
    assert _link(nodes[0], "n2", "n4") is None
    res = cluster.cli(n4, "link", "add", "n2")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: all(_link(n, "n2", "n4") for n in nodes), "link n2-n4 everywhere")
    # n4 measured the latency itself while its request went to the scheduler
    assert (_link(nodes[0], "n2", "n4") or {}).get("latency_s") is not None
    wait_until(lambda: (_link(nodes[0], "n2", "n4") or {}).get("bandwidth_bps"), "link measured")
    # the measuring end shows its own measurement too, even when it commits no new epoch
    wait_until(lambda: (_link(n4, "n2", "n4") or {}).get("bandwidth_bps"), "n4 shows it")
    res = cluster.cli(n4, "link", "add", "ghost")
    assert res.returncode != 0 and "unknown_peer" in res.stderr
    res = cluster.cli(n4, "link", "add", "n2")  # already up: refused, nothing measured commits
    assert res.returncode != 0 and "already up" in res.stderr
    assert n4.alive() and nodes[0].alive()
    assert "n4" in next(x for x in n2.status().nodes if x.id == "n2").neighbors

    res = cluster.cli(n2, "link", "remove", "n4")  # from n2
    assert res.returncode == 0, res.stderr
    wait_until(lambda: all(_link(n, "n2", "n4") is None for n in nodes), "link removed")
    # n2-n3 goes; then n1-n2 is n2's only link and removing it would split the overlay
    res = cluster.cli(nodes[1], "link", "remove", "n3")
    assert res.returncode == 0, res.stderr
    res = cluster.cli(nodes[0], "link", "remove", "n2")
    assert res.returncode != 0 and "would_disconnect" in res.stderr
    assert _link(nodes[0], "n1", "n2") is not None


def test_link_cut_is_disconnect_link_not_a_failure(cluster: Cluster) -> None:
    nodes = cluster.start(4)
    n3, n4 = nodes[2], nodes[3]
    assert _link(nodes[0], "n3", "n4") is not None
    with n3.local_client() as c:
        c.fault("cut_link", ["n4"])
    with n4.local_client() as c:
        c.fault("cut_link", ["n3"])
    wait_until(lambda: (_link(nodes[0], "n3", "n4") or {}).get("up") is False, "n3-n4 down")
    assert cluster.members(nodes[0]) == {"n1", "n2", "n3", "n4"}
    assert all(n.status().state == "active" for n in nodes)
    ev = nodes[0].events()
    assert not any(e["event"] == "node_failed" for e in ev)
    cut = [e for e in ev if e["event"] == "committed" and e["cause"] == "disconnect_link"]
    assert cut and cut[-1]["restart_allreduce"] is True
    # healing the link reports it back up (connect-link)
    for n in (n3, n4):
        with n.local_client() as c:
            c.fault("clear", [])
    wait_until(lambda: (_link(nodes[0], "n3", "n4") or {}).get("up"), "link back up")


def test_partition_minority_pauses_majority_goes_on(cluster: Cluster) -> None:
    nodes = cluster.start(5)
    minority = ["n1", "n2"]  # holds the scheduler: the hard case
    majority = ["n3", "n4", "n5"]
    for n in nodes:
        side = minority if n.id in minority else majority
        with n.local_client() as c:
            c.fault("partition", side)
    by_id = {n.id: n for n in nodes}
    wait_until(lambda: all(by_id[m].status().paused for m in minority), "minority paused")
    maj = [by_id[m] for m in majority]
    new = wait_until(lambda: _agree(maj) in majority and _agree(maj), "majority elects")
    assert new in majority
    wait_until(lambda: all(cluster.members(n) == set(majority) for n in maj), "majority view")
    # the paused minority made no change of its own
    for m in minority:
        st = by_id[m].status()
        assert st.paused and st.role != "scheduler"
        assert {x.id for x in st.nodes} >= set(minority)
    res = cluster.cli(by_id["n1"], "link", "add", "n3")
    assert res.returncode != 0 and "paused" in res.stderr
    # heal: the minority rejoins the majority's cluster
    for n in nodes:
        with n.local_client() as c:
            c.fault("clear", [])
    everyone = {n.id for n in nodes}
    wait_until(
        lambda: all(cluster.members(n) == everyone and not n.status().paused for n in nodes),
        "partition healed",
        timeout_s=45,
    )
    assert len({scheduler_of(n) for n in nodes}) == 1
