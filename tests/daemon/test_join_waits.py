"""A trainer's join waits for a scheduler up to ``join_timeout_s``: real daemons on loopback.

The registration is relayed to a scheduler that then stays silent (SIGSTOP) for several times
``op_timeout_s`` while no other scheduler can be elected; when it finally dies and another is
elected, the registration is sent again and the join completes. Before, it failed after
``op_timeout_s`` (``timeout``), or at once (``paused``) when no scheduler was known.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from daemon_helpers import Cluster, in_background, wait_until

from chaos.errors import ChaosTimeout
from chaos.protocol import OpResult, TrainerReady
from chaos.trainer.session import DaemonSession

OP_TIMEOUT_S = 1.0


def test_a_join_outlasts_op_timeout_while_no_scheduler_answers(cluster: Cluster) -> None:
    with cluster.config.open("a") as f:
        f.write(f"op_timeout_s = {OP_TIMEOUT_S}\njoin_timeout_s = 60.0\n")
    n1, n2, n3 = cluster.start(3)
    assert n3.status().scheduler == n1.id
    # the scheduler and n2 freeze: n3 alone is a minority, no other scheduler can be elected
    n1.proc.send_signal(signal.SIGSTOP)
    n2.proc.send_signal(signal.SIGSTOP)
    t, answer = in_background(
        lambda c: c.register_trainer(
            "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", True, [64, 32], timeout_s=60.0
        ),
        n3.ipc,
    )
    wait_until(lambda: n3.status().paused, "n3 paused (no majority)")
    time.sleep(3 * OP_TIMEOUT_S)  # no scheduler answers for longer than op_timeout_s
    assert "error" not in answer, answer.get("error")
    assert t.is_alive(), answer
    cluster.kill9(n1)
    n2.proc.send_signal(signal.SIGCONT)
    t.join(timeout=60.0)
    assert not t.is_alive()
    assert "error" not in answer, answer.get("error")
    result = answer["result"]
    assert isinstance(result, OpResult) and result.ok
    kinds = {e["event"] for e in n3.events() if e.get("type") == "TrainerInfo"}
    assert kinds & {"relay_resent", "relay_held"} or "relayed" in kinds
    wait_until(
        lambda: {n.id: n.trainer.value for n in n2.status().nodes}.get(n3.id) == "training",
        "the new scheduler's members see n3 training",
    )


def test_a_ready_report_with_no_scheduler_is_held_not_refused(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    with n3.client() as c:
        c.register_trainer("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", True, [64, 32])
    n1.proc.send_signal(signal.SIGSTOP)
    n2.proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: n3.status().paused, "n3 paused (no majority)")
    t, answer = in_background(
        lambda c: c.trainer_event(TrainerReady(elapsed_s=1.0, detail="test"), timeout_s=30.0),
        n3.ipc,
        timeout_s=30.0,
    )
    wait_until(
        lambda: [e for e in n3.events() if e["event"] in ("relay_held", "relayed")] or answer,
        "n3 took the ready report",
    )
    cluster.kill9(n1)
    n2.proc.send_signal(signal.SIGCONT)
    t.join(timeout=30.0)
    assert not t.is_alive()
    assert "error" not in answer, answer.get("error")
    assert isinstance(answer["result"], OpResult) and answer["result"].ok


class _FlakyLink:
    """A daemon link whose first ``ready`` report is lost (no answer), the next answered."""

    def __init__(self) -> None:
        self.calls = 0

    def trainer_event(self, *args: Any, **kwargs: Any) -> OpResult:
        self.calls += 1
        if self.calls == 1:
            raise ChaosTimeout("lost in a scheduler change")
        return OpResult(sender="a", epoch=1, op_id="x", ok=True)


def test_the_trainer_sends_a_lost_ready_report_again() -> None:
    link = _FlakyLink()
    session = DaemonSession(
        link,  # type: ignore[arg-type]
        "a",
        poll_interval_s=0.01,
        policy_timeout_s=5.0,
        policy_notices=False,
        contact_since=time.monotonic(),
    )
    session.report_ready(1.0, "test", 0)
    assert link.calls == 2
