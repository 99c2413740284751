"""A join under an admitted member's id, at its own address, told apart by the incarnation
nonce: the same nonce within the failure timeout is a retry that missed its admission (the last
update is sent again); a new nonce is a restarted daemon (the old incarnation is replaced).

The scheduler role in process, with a host that records what it would send.
"""

from __future__ import annotations

from typing import Any

from chaos.protocol import ClusterUpdate, JoinRequest, LinkReport
from tests.daemon.recorder import Recorder, recording_context

ADDRESS = "tcp://127.0.0.1:99"


def _admitted(incarnation: str) -> tuple[Any, Recorder]:
    """A scheduler ``a`` with member b, which has just admitted ``d`` under ``incarnation``."""
    from chaos.daemon.config import DaemonConfig
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol.states import NodeState

    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:1", heartbeat_interval_s=0.2,
                       failure_timeout_s=1.0)  # fmt: skip
    ctx, host = recording_context(cfg)
    role = SchedulerRole(ctx, None, 0.0)
    role.monitor.add_node("b", "tcp://127.0.0.1:10", NodeState.ACTIVE, 0.0)
    role.failures.heard("b", 1.0)
    role.scale_outs.on_join(_join(incarnation), None, 1.0)
    [so] = role.scale_outs.joins.values()
    role.scale_outs.take(
        LinkReport(sender="b", term=1, peer="d", up=True, latency_s=0.001, op_id=so.op_id), 1.1
    )
    assert role.monitor.state("d") == NodeState.ACTIVE
    return role, host


def _join(incarnation: str) -> JoinRequest:
    return JoinRequest(sender="d", node_id="d", address=ADDRESS, neighbors=["b"],
                       incarnation=incarnation)  # fmt: skip


def test_the_same_incarnation_soon_after_admission_gets_the_admission_again() -> None:
    role, host = _admitted("first")
    role.scale_outs.on_join(_join("first"), None, 1.3)
    assert host.named("incarnation_replaced") == []
    assert role.monitor.has("d") and "d" not in role.scale_outs.joins
    resent = [m for peer, m in host.sent if peer == "d" and isinstance(m, ClusterUpdate)]
    assert resent and resent[-1] is role.ledger.last_update


def test_the_same_incarnation_after_the_failure_timeout_is_a_restart() -> None:
    role, host = _admitted("first")
    role.failures.heard("d", 2.5)
    role.scale_outs.on_join(_join("first"), None, 2.6)  # 1.5 s after admission > 1.0 s
    [ev] = host.named("incarnation_replaced")
    assert ev["peer"] == "d"


def test_a_new_incarnation_at_the_same_address_replaces_the_old_one() -> None:
    role, host = _admitted("first")
    role.scale_outs.on_join(_join("second"), None, 1.3)
    [ev] = host.named("incarnation_replaced")
    assert ev["peer"] == "d" and ev["was_fresh"] is True
    # scaled out anew: the join is in progress again
    assert "d" in role.scale_outs.joins
