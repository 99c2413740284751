"""A trainer's registration in flight when the scheduler dies: real daemons on loopback.

The member relays its trainer's registration to the scheduler. If the scheduler dies before it
answers, the member sends the registration again to the new scheduler, and the trainer's join
completes instead of timing out.
"""

from __future__ import annotations

import signal

from chaos.daemon.client import DaemonClient
from daemon_helpers import Cluster, Node, in_background, wait_until

from chaos.protocol import OpResult

FAULTS = ("--enable-fault-injection",)


def _fault(node: Node, name: str, peers: list[str]) -> None:
    with DaemonClient(node.ipc, timeout_s=5.0) as c:
        c.fault(name, peers)  # type: ignore[arg-type]


def test_a_registration_in_flight_is_sent_again_to_the_new_scheduler(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    assert n3.status().scheduler == n1.id
    # the scheduler freezes (SIGSTOP): n3's relayed registration waits unread in its socket
    n1.proc.send_signal(signal.SIGSTOP)
    t, answer = in_background(
        lambda c: c.register_trainer(
            "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", True, [64, 32], timeout_s=60.0
        ),
        n3.ipc,
    )
    relayed = wait_until(
        lambda: [e for e in n3.events() if e["event"] == "relayed"],
        "n3 relayed the registration",
    )
    assert relayed[0]["type"] == "TrainerInfo" and relayed[0]["scheduler"] == n1.id
    cluster.kill9(n1)  # dies without having read it
    t.join(timeout=60.0)
    assert not t.is_alive()
    assert "error" not in answer, answer.get("error")
    result = answer["result"]
    assert isinstance(result, OpResult) and result.ok
    resent = [e for e in n3.events() if e["event"] == "relay_resent"]
    assert resent and resent[0]["type"] == "TrainerInfo" and resent[0]["scheduler"] != n1.id
    wait_until(
        lambda: {n.id: n.trainer.value for n in n2.status().nodes}.get(n3.id) == "training",
        "the new scheduler's members see n3 training",
    )


def test_a_registration_lost_with_a_member_cut_off_is_sent_again_when_it_rejoins(
    cluster: Cluster,
) -> None:
    """n3 relays its trainer's registration to the scheduler just as n3 is cut off (the others
    drop its frames): the registration is lost with n3, whom the scheduler then evicts. After
    the heal n3 joins again under the same scheduler and term; the registration goes to it
    again, and the
    trainer's join completes. Before, a scheduler known again unchanged was not sent the
    waiting requests, and the trainer waited for an answer until its deadline (a campaign's
    trainer so stayed out of training to the end of the run)."""
    n1 = cluster.spawn("n1", extra=FAULTS)
    n2 = cluster.spawn("n2", join=n1, neighbors=(n1.id,), extra=FAULTS)
    n3 = cluster.spawn("n3", join=n2, neighbors=(n2.id, n1.id), extra=FAULTS)
    ids = {n1.id, n2.id, n3.id}
    wait_until(lambda: all(cluster.members(x) == ids for x in (n1, n2, n3)), "all joined")
    term = n3.status().term
    for node in (n1, n2):  # they drop n3's frames; n3 still sends (into the cut)
        _fault(node, "cut_link", [n3.id])
    t, answer = in_background(
        lambda c: c.register_trainer(
            "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", True, [64, 32], timeout_s=90.0
        ),
        n3.ipc,
    )
    relayed = wait_until(
        lambda: [e for e in n3.events() if e["event"] == "relayed"], "n3 relayed it"
    )
    assert relayed[0]["scheduler"] == n1.id  # into the partition: lost
    wait_until(lambda: n3.id not in cluster.members(n1), "the scheduler evicted n3")
    for node in (n1, n2):
        _fault(node, "clear", [])
    t.join(timeout=90.0)
    assert not t.is_alive()
    assert "error" not in answer, answer.get("error")
    result = answer["result"]
    assert isinstance(result, OpResult) and result.ok, result
    assert n1.status().scheduler == n1.id and n1.status().term == term  # the same one
    resent = [e for e in n3.events() if e["event"] == "relay_resent"]
    assert resent and resent[-1]["scheduler"] == n1.id
