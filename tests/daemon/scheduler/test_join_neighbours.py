"""A join's named neighbours on the scheduler: one that is no member is left out while another
is (the joiner comes in through the others); none a member: refused ``unknown_peer``.

The scheduler role in process, with a host that records what it would send.
"""

from __future__ import annotations

from typing import Any

from chaos.protocol import JoinRequest, Refusal
from tests.daemon.recorder import Recorder, recording_context


def _role() -> tuple[Any, Recorder]:
    """A scheduler ``a`` with members b and c."""
    from chaos.daemon.config import DaemonConfig
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol.states import NodeState

    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:1", heartbeat_interval_s=0.2,
                       failure_timeout_s=1.0)  # fmt: skip
    ctx, host = recording_context(cfg)
    role = SchedulerRole(ctx, None, 0.0)
    for i, n in enumerate("bc"):
        role.monitor.add_node(n, f"tcp://127.0.0.1:{10 + i}", NodeState.ACTIVE, 0.0)
    return role, host


def _join(node: str, *neighbors: str) -> JoinRequest:
    return JoinRequest(sender=node, node_id=node, address="tcp://127.0.0.1:99",
                       neighbors=list(neighbors))  # fmt: skip


def test_a_named_neighbour_that_is_no_member_is_left_out() -> None:
    role, host = _role()
    role.scale_outs.on_join(_join("d", "b", "ghost"), None, 1.0)
    [ev] = host.named("scale_out_started")
    assert ev["peer"] == "d" and ev["neighbors"] == ["b"] and ev["dropped"] == ["ghost"]
    assert role.monitor.has("d") and not role.monitor.has("ghost")
    # b is asked to connect to the joiner; nobody is asked about the ghost
    assert [peer for peer, _msg in host.sent] == ["b"]
    assert host.named("join_refused") == []


def test_a_join_whose_named_neighbours_are_all_unknown_is_refused() -> None:
    role, host = _role()
    role.scale_outs.on_join(_join("d", "ghost", "phantom"), None, 1.0)
    [ev] = host.named("join_refused")
    assert ev["reason"] == "unknown_peer" and "ghost" in ev["detail"]
    assert not role.monitor.has("d") and host.named("scale_out_started") == []
    refusals = [m for m in host.sent_to_address if isinstance(m, Refusal)]
    assert refusals and refusals[-1].reason == "unknown_peer"
