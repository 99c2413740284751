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


_JOINER_PATH: Any = object()  # stands in for the connection the join came over (a ReplyPath)


def test_a_joiner_no_neighbour_could_reach_is_refused_back_over_its_own_connection() -> None:
    """b reports it could not connect to the joiner (behind NAT, say): the refusal names the
    address and what to do, and goes back over the connection the join came over, not to the
    joiner's address (which nobody can reach)."""
    from chaos.protocol import LinkReport

    role, host = _role()
    role.scale_outs.on_join(_join("d", "b"), _JOINER_PATH, 1.0)
    [so] = role.scale_outs.joins.values()
    role.on_link_report(LinkReport(sender="b", term=0, peer="d", up=False, op_id=so.op_id), 2.0)
    [ev] = host.named("join_refused")
    assert ev["reason"] == "joiner_unreachable"
    assert "b could not connect to tcp://127.0.0.1:99" in ev["detail"]
    assert "Devices behind NAT" in ev["detail"]
    assert host.answered_to == [_JOINER_PATH] and host.sent_to_address == []
    [no] = host.answers
    assert no.reason == "joiner_unreachable" and no.joiner is None  # the joiner's own
    assert not role.monitor.has("d")


def test_a_forwarded_joins_refusal_goes_to_the_forwarder_naming_the_joiner() -> None:
    import msgspec

    role, host = _role()
    fwd = msgspec.structs.replace(_join("d", "ghost"), forwarded_by="c", sender="c")
    role.scale_outs.on_join(fwd, _JOINER_PATH, 1.0)  # the path is c's connection here
    [no] = host.answers
    assert host.answered_to == [_JOINER_PATH]
    assert no.reason == "unknown_peer" and no.joiner == "d" and no.ref_type == "join_request"
