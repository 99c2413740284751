"""A trainer's registration in flight when the scheduler dies: real daemons on loopback.

The member relays its trainer's registration to the scheduler. If the scheduler dies before it
answers, the member sends the registration again to the new scheduler, and the trainer's join
completes instead of timing out.
"""

from __future__ import annotations

import signal

from daemon_helpers import Cluster, in_background, wait_until

from chaos.protocol import OpResult


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
