"""This node's own join and leave (:class:`chaos.daemon.membership.Membership`).

The unit tests drive ``Membership`` with a recording context in place of the daemon's: they are
about the join and leave bookkeeping (resends, deadlines, answers), not about sockets. The last test
runs a real ``chaos-daemon`` whose join can never be answered.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from chaos.daemon.config import DaemonConfig
from chaos.daemon.events import read_events
from chaos.daemon.membership import Membership
from chaos.daemon.states import DaemonState
from daemon_helpers import free_port

from chaos.launch import daemon_command, daemon_env
from chaos.protocol import (
    ClusterUpdate,
    ClusterView,
    JoinRequest,
    LeaveRequest,
    Message,
    NodeInfo,
    OpResult,
    PolicyAck,
    Reason,
    Refusal,
    SyncPolicyWire,
    decode,
)
from tests.daemon.recorder import Recorder, recording_context

_CLIENT: Any = object()  # stands in for the client's reply path (a ReplyPath)


class _Transport:
    def __init__(self) -> None:
        self.contacts: list[tuple[str, Message]] = []

    def send_contact(self, address: str, frame: bytes) -> None:
        self.contacts.append((address, decode(frame)))

    def close_contacts(self) -> None:
        pass

    def refused_contact(self) -> str | None:
        return None  # no handshake refused (tests/daemon/test_wrong_key.py covers a refusal)


class _Host:
    """The membership's context, recording (the daemon is not under test here), and its
    contacts."""

    def __init__(self, state: DaemonState = DaemonState.STARTING, scheduler: bool = True) -> None:
        self.address = "tcp://127.0.0.1:7000"
        self.cfg = DaemonConfig(node_id="me", listen=self.address, join_timeout_s=10.0)
        self.ctx, self.rec = recording_context(self.cfg, Recorder(scheduler), state=state)
        self.transport: Any = _Transport()

    def membership(self) -> Membership:
        return Membership(self.ctx, self.transport)

    @property
    def state(self) -> DaemonState:
        return self.ctx.facts.state

    @property
    def view(self) -> ClusterView | None:
        return self.ctx.facts.view

    @view.setter
    def view(self, view: ClusterView | None) -> None:
        self.ctx.facts.view = view

    @property
    def exit_code(self) -> int | None:
        return self.ctx.facts.exit_code if self.ctx.facts.stopping else None

    @property
    def events(self) -> list[tuple[str, dict[str, object]]]:
        return self.rec.events

    @property
    def answers(self) -> list[Message]:
        return self.rec.answers

    @property
    def answered_to(self) -> list[Any]:
        return self.rec.answered_to

    @property
    def to_sched(self) -> list[Message]:
        return self.rec.to_sched


def _joins(host: _Host) -> list[JoinRequest]:
    return [m for _, m in host.transport.contacts if isinstance(m, JoinRequest)]


def test_a_join_is_resent_until_answered_then_times_out() -> None:
    host = _Host()
    ms = host.membership()
    ms.begin_join(100.0, ["tcp://127.0.0.1:7001"], ["a"])
    assert host.state == DaemonState.JOINING
    first = _joins(host)
    assert len(first) == 1 and first[0].neighbors == ["a"] and first[0].address == host.address
    ms.tick(100.1)  # too soon to resend
    assert len(_joins(host)) == 1
    ms.tick(100.0 + max(0.5, 2 * host.cfg.heartbeat_interval_s))  # sent again, fresh op id
    again = _joins(host)
    assert len(again) == 2 and again[1].op_id != again[0].op_id
    assert host.exit_code is None
    ms.tick(110.5)  # past join_timeout_s
    assert host.exit_code == 4
    name, fields = host.events[-1]
    assert name == "join_failed" and fields["reason"] == "timeout"
    # nothing ever came back: the error says no contact could be reached, and which
    assert fields["detail"].startswith("no contact ever answered (tcp://127.0.0.1:7001)")


def test_a_joiner_nobody_can_reach_asks_again_and_its_timeout_names_why() -> None:
    """``joiner_unreachable`` (no member could dial this device back): the join is asked
    again, not given up at once (the probes may have failed for a moment), and the timeout's
    error names the refusal's words."""
    host = _Host()
    ms = host.membership()
    ms.begin_join(100.0, ["tcp://127.0.0.1:7001"], [])
    why = "a could not connect to tcp://127.0.0.1:7000, the address this device advertises"
    no = Refusal(sender="s", reason=Reason.JOINER_UNREACHABLE, detail=why,
                 ref_type="join_request")  # fmt: skip
    assert ms.on_refusal(no) and ms.on_refusal(no)
    assert host.exit_code is None and host.state == DaemonState.JOINING
    assert [e for e, _ in host.events].count("join_unreachable") == 1  # said once
    ms.tick(101.0)
    assert len(_joins(host)) == 2  # asked again
    ms.tick(110.5)
    assert host.exit_code == 4
    assert host.events[-1] == ("join_failed", {"reason": "timeout", "detail": why})


def test_a_member_hands_the_schedulers_refusal_of_a_join_it_forwarded_to_the_joiner() -> None:
    """A member forwards a join to its scheduler and keeps the way back; the scheduler's
    refusal naming the joiner goes back over the joiner's own connection. One from anyone
    but the scheduler, or for a joiner it never forwarded, goes nowhere."""
    host = _Host(DaemonState.ACTIVE)
    host.ctx.facts.election.adopt(1, "s", 1.0)
    ms = host.membership()
    join = JoinRequest(sender="j", node_id="j", address="tcp://192.168.1.5:7000")
    joiner_path: Any = object()
    ms.on_join_request(join, joiner_path, 2.0)
    [(to, fwd)] = host.rec.sent
    assert to == "s" and fwd.forwarded_by == "me"
    no = Refusal(sender="s", reason=Reason.JOINER_UNREACHABLE, detail="nobody could connect",
                 ref_type="join_request", joiner="j")  # fmt: skip
    forged = msgspec.structs.replace(no, sender="x")
    other = msgspec.structs.replace(no, joiner="k")
    assert ms.on_refusal(forged) and ms.on_refusal(other)
    assert host.answers == []
    assert ms.on_refusal(no)
    assert host.answered_to == [joiner_path]
    assert host.answers[0].joiner is None and host.answers[0].detail == "nobody could connect"
    ms.tick(2.0 + 121.0)  # the way back is forgotten after a while
    assert ms.on_refusal(no) and len(host.answers) == 1


def test_a_leave_without_a_scheduler_fails_at_once_and_stops() -> None:
    host = _Host(DaemonState.ACTIVE, scheduler=False)
    host.membership().start_leave(_CLIENT, 5.0)
    assert host.state == DaemonState.STOPPED and host.answered_to == [_CLIENT]
    answer = host.answers[-1]
    assert isinstance(answer, OpResult) and not answer.ok and answer.reason == "paused"
    assert host.exit_code == 0


def test_an_unanswered_leave_times_out_and_another_answer_is_not_taken_for_it() -> None:
    host = _Host(DaemonState.ACTIVE)
    ms = host.membership()
    ms.start_leave(_CLIENT, 5.0)
    assert host.state == DaemonState.LEAVING
    (req,) = host.to_sched
    assert isinstance(req, LeaveRequest) and req.node_id == "me"
    assert ms.leave_request().op_id == req.op_id  # what is resent to a new scheduler
    other = OpResult(sender="s", epoch=1, op_id="someone-else", ok=True)
    assert not ms.on_leave_result(other)
    ms.tick(5.0 + host.cfg.leave_timeout_s - 0.1)
    assert host.exit_code is None
    ms.tick(5.0 + host.cfg.leave_timeout_s + 0.1)
    answer = host.answers[-1]
    assert isinstance(answer, OpResult) and answer.op_id == req.op_id
    assert not answer.ok and answer.reason == "timeout" and host.exit_code == 0


def test_the_schedulers_answer_finishes_the_leave() -> None:
    host = _Host(DaemonState.ACTIVE)
    ms = host.membership()
    ms.start_leave(_CLIENT, 5.0)
    op_id = ms.leave_request().op_id
    assert ms.on_leave_result(OpResult(sender="s", epoch=7, op_id=op_id, ok=True, elapsed_s=0.2))
    answer = host.answers[-1]
    assert isinstance(answer, OpResult) and answer.ok and answer.epoch == 7
    assert host.exit_code == 0


def _node(nid: str, port: int, neighbors: list[str]) -> NodeInfo:
    return NodeInfo(
        id=nid, address=f"tcp://127.0.0.1:{port}", state="active", joined_at=0.0,
        neighbors=neighbors,
    )  # fmt: skip


def test_a_dropped_member_rejoins_through_the_sender_with_its_remaining_neighbours() -> None:
    host = _Host(DaemonState.ACTIVE)
    host.view = ClusterView(epoch=3, term=1, scheduler="s", links=[], nodes=[
        _node("s", 7001, ["me"]), _node("a", 7002, ["me"]), _node("me", 7000, ["s", "a"]),
    ])  # fmt: skip
    newer = ClusterView(epoch=4, term=1, scheduler="s", links=[], nodes=[
        _node("s", 7001, []), _node("b", 7003, []),
    ])  # fmt: skip
    host.membership().rejoin(newer, "s", 10.0)
    assert host.state == DaemonState.JOINING
    (address, req), = host.transport.contacts  # fmt: skip
    assert address == "tcp://127.0.0.1:7001" and isinstance(req, JoinRequest)
    assert req.neighbors == ["s"]  # "a" is no longer a member
    assert host.events[0] == ("rejoining", {"via": "s", "neighbors": ["s"]})


def _update(view: ClusterView, sender: str) -> ClusterUpdate:
    sync = SyncPolicyWire(kind="single", nodes=[n.id for n in view.nodes])
    return ClusterUpdate(sender=sender, epoch=view.epoch, term=1, view=view, sync=sync)


def test_a_view_without_this_node_ends_a_leave_or_starts_a_rejoin() -> None:
    old = ClusterView(epoch=3, term=1, scheduler="s", links=[],
                      nodes=[_node("s", 7001, ["me"]), _node("me", 7000, ["s"])])  # fmt: skip
    without = ClusterView(epoch=4, term=1, scheduler="s", links=[], nodes=[_node("s", 7001, [])])
    # leaving: the scheduler's view without this node completes the leave, answer or not
    host = _Host(DaemonState.ACTIVE)
    ms = host.membership()
    ms.start_leave(_CLIENT, 5.0)
    ms.on_dropped_from_view(_update(without, "s"), None, 5.5)
    acks = [m for m in host.answers if isinstance(m, PolicyAck)]
    done = [m for m in host.answers if isinstance(m, OpResult)]
    assert acks and acks[0].epoch == 4 and done and done[0].ok and host.exit_code == 0
    # active: dropped (a missed heartbeat), so it joins again through the sender
    host = _Host(DaemonState.ACTIVE)
    host.view = old
    host.membership().on_dropped_from_view(_update(without, "s"), None, 6.0)
    assert host.state == DaemonState.JOINING and len(_joins(host)) == 1
    # its own view (a scheduler that removed itself) starts nothing
    host = _Host(DaemonState.ACTIVE)
    host.view = old
    host.membership().on_dropped_from_view(_update(without, "me"), None, 6.0)
    assert host.state == DaemonState.ACTIVE and not _joins(host)


def test_a_rejoin_through_an_unknown_sender_does_nothing() -> None:
    host = _Host(DaemonState.ACTIVE)
    host.membership().rejoin(None, "stranger", 10.0)
    assert host.state == DaemonState.ACTIVE and not host.transport.contacts


def test_a_daemon_whose_join_is_never_answered_exits_with_code_4(tmp_path: Path) -> None:
    config = tmp_path / "daemon.toml"
    config.write_text("join_timeout_s = 1.0\n")
    port, other = free_port(), free_port()
    while other == port:
        other = free_port()
    args = daemon_command(
        "lonely",
        f"tcp://127.0.0.1:{port}",
        join=f"tcp://127.0.0.1:{other}",  # nothing listens there
        config=config,
    )
    env = daemon_env(tmp_path)
    try:
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:  # run() killed and reaped it
        pytest.fail(f"the daemon did not give its join up: {exc}")
    assert res.returncode == 4, res.stderr
    assert "join timed out" in res.stderr
    names = [e["event"] for e in read_events(tmp_path / "events-lonely.jsonl")]
    assert names[0] == "started" and "join_failed" in names and names[-1] == "stopped"
