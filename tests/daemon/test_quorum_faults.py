"""A crash and a graceful leave inside one failure-detection window (real daemons on loopback).

The quorum base is the membership of the newest committed epoch: once the leave is committed,
the leaver no longer counts, so the two survivors of four are a majority of the three members
left and the scheduler removes the crashed member instead of pausing. Faults are injected by
name (SIGKILL, the ``leave`` request that ``chaos-daemon leave`` sends); the test waits on
events and status, never on a sleep.
"""

from __future__ import annotations

from daemon_helpers import Cluster, Node, wait_until


def _events(node: Node, name: str) -> list[dict[str, object]]:
    return [e for e in node.events() if e["event"] == name]


def _one_scheduler(nodes: list[Node]) -> str | None:
    """The scheduler if exactly one node holds the role, every node follows it, none pauses."""
    sts = [n.status() for n in nodes]
    roles = [s.node_id for s in sts if s.role == "scheduler"]
    followed = {s.scheduler for s in sts}
    if len(roles) == 1 and followed == {roles[0]} and not any(s.paused for s in sts):
        return roles[0]
    return None


def test_crash_and_leave_in_one_window_keep_one_working_scheduler(cluster: Cluster) -> None:
    """SIGKILL n2 and make n4 leave at once: n1 and n3 (2 of the 3 members left) go on."""
    n1, n2, n3, n4 = cluster.start(4)
    wait_until(lambda: _one_scheduler([n1, n2, n3, n4]) == "n1", "n1 schedules")
    cluster.kill9(n2)  # before it can acknowledge the leave's epoch
    with n4.local_client(timeout_s=10.0) as c:
        left = c.leave(timeout_s=10.0)  # answered once the view without n4 is acknowledged
    wait_until(
        lambda: any(e["cause"] == "scale_in_leave" for e in _events(n1, "committed")),
        "the leave committed",
    )
    survivors = [n1, n3]
    wait_until(
        lambda: (
            all(cluster.members(n) == {"n1", "n3"} for n in survivors)
            or any(_events(n, "quorum_lost") for n in survivors)
        ),
        "n2 removed (or a survivor lost its quorum)",
    )
    for n in survivors:
        assert not _events(n, "quorum_lost"), (n.id, _events(n, "quorum_lost"))
        assert not _events(n, "paused"), n.id
        assert {e["peer"] for e in _events(n, "node_failed")} <= {"n2"}, n.id
    sched = wait_until(lambda: _one_scheduler(survivors), "one scheduler, nobody paused")
    assert sched == "n1"
    assert left.ok, left
    assert n4.proc.wait(timeout=15) == 0
    # the cluster still takes a join
    n5 = cluster.spawn("n5", join=n3, neighbors=("n3",))
    everyone = [n1, n3, n5]
    wait_until(lambda: all(cluster.members(n) == {"n1", "n3", "n5"} for n in everyone), "n5 joined")
    assert _one_scheduler(everyone) == "n1"
