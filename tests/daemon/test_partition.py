"""Network partitions: the majority side goes on, the minority pauses, the heal rejoins it.

Five real daemons on loopback; the partition is the daemons' named transport fault
(``fault partition``), injected on every daemon through its local IPC socket, so each side
loses every frame from the other, as a real partition would. No timing is asserted.
"""

from __future__ import annotations

import pytest
from chaos.daemon.client import DaemonClient

from tests.daemon.daemon_helpers import Cluster, Node, wait_until

FAULTS = ("--enable-fault-injection",)


def start(cluster: Cluster, n: int) -> list[Node]:
    nodes = [cluster.spawn("n1", extra=FAULTS)]
    for i in range(2, n + 1):
        prev = nodes[-1]
        nbrs = (prev.id,) if i < 3 else (prev.id, nodes[0].id)
        nodes.append(cluster.spawn(f"n{i}", join=prev, neighbors=nbrs, extra=FAULTS))
    ids = {x.id for x in nodes}
    wait_until(lambda: all(cluster.members(x) == ids for x in nodes), "everyone sees everyone")
    return nodes


def fault(node: Node, name: str, peers: list[str]) -> None:
    with DaemonClient(node.ipc, timeout_s=5.0) as c:
        c.fault(name, peers)  # type: ignore[arg-type]


def partition(sides: list[list[Node]]) -> None:
    for side in sides:
        keep = [n.id for n in side]
        for node in side:
            fault(node, "partition", keep)


@pytest.mark.parametrize("scheduler_in_minority", [False, True])
def test_the_majority_goes_on_the_minority_pauses_and_rejoins_after_the_heal(
    cluster: Cluster, scheduler_in_minority: bool
) -> None:
    nodes = start(cluster, 5)
    scheduler = nodes[0].status().scheduler
    by_id = {n.id: n for n in nodes}
    others = [n for n in nodes if n.id != scheduler]
    if scheduler_in_minority:
        minority = [by_id[scheduler], others[0]]
    else:
        minority = others[:2]
    majority = [n for n in nodes if n not in minority]
    partition([minority, majority])

    big = {n.id for n in majority}
    wait_until(
        lambda: all(cluster.members(n) == big and not n.status().paused for n in majority),
        "the majority to go on alone",
        timeout_s=60.0,
    )
    wait_until(
        lambda: all(n.status().paused or n.status().scheduler is None for n in minority),
        "the minority to pause",
        timeout_s=60.0,
    )
    new_scheduler = majority[0].status().scheduler
    assert new_scheduler in big  # never a scheduler on the minority side that commits

    for node in nodes:
        fault(node, "clear", [])
    everyone = {n.id for n in nodes}
    wait_until(
        lambda: all(cluster.members(n) == everyone and not n.status().paused for n in nodes),
        "the minority to rejoin after the heal",
        timeout_s=90.0,
    )
    assert all(n.alive() for n in nodes)
