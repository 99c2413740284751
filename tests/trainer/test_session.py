"""The trainer's daemon session on its own: policies read from replies, polled, waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import pytest

from chaos.errors import ChaosTimeout, ProtocolError
from chaos.protocol import NodeInfo, NodeState, PolicyReply, StatusReply, SyncPolicyWire
from chaos.trainer import TrainingStalled
from chaos.trainer.session import DaemonSession, topology_epoch, topology_of

ADDRS = {n: f"tcp://127.0.0.1:{5000 + i}" for i, n in enumerate("abc")}


def _reply(epoch: int, sync: SyncPolicyWire | None, **kw: object) -> PolicyReply:
    members = list(sync.nodes) if sync is not None else ["a"]
    return PolicyReply(epoch=epoch, term=1, members=members, sync=sync, **kw)  # type: ignore[arg-type]


def _ring(topology_epoch: int = 0, connected: bool = True) -> SyncPolicyWire:
    return SyncPolicyWire(
        kind="ring",
        nodes=["a", "b", "c"],
        ring=["a", "c", "b"],
        addresses=ADDRS,
        topology_epoch=topology_epoch,
        connected=connected,
    )


class FakeDaemon:
    """Answers a session's requests from a script (a reply, or an exception to raise)."""

    def __init__(self, replies: list[PolicyReply | Exception]) -> None:
        self.replies = replies
        self.events: list[tuple[str, str, int]] = []
        self.closed = False

    def policy(self, timeout_s: float | None = None) -> PolicyReply:
        item = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(item, Exception):
            raise item
        return item

    def register_trainer(self, *args: object, **kwargs: object) -> object:
        return None  # the session's registration is not under test here

    def trainer_event(
        self,
        kind: Literal["ready", "step_failed"],
        elapsed_s: float = 0.0,
        detail: str = "",
        timeout_s: float | None = None,
        epoch: int = 0,
    ) -> object:
        if kind == "step_failed":
            raise ProtocolError("refused")
        self.events.append((kind, detail, epoch))
        return None

    def status(self, timeout_s: float | None = None) -> StatusReply:
        node = NodeInfo(id="a", address="tcp://127.0.0.1:1", state=NodeState.ACTIVE, joined_at=0.0,
                        neighbors=["c", "b"])  # fmt: skip
        return StatusReply(node_id="a", role="follower", state="member", paused=False,
                           scheduler="a", term=1, nodes=[node], links=[])  # fmt: skip

    def leave(
        self, timeout_s: float | None = None, gone: Callable[[], bool] | None = None
    ) -> object:
        return None

    def close(self) -> None:
        self.closed = True


def _session(
    daemon: FakeDaemon, policy_timeout_s: float = 10.0, since: float = 0.0
) -> DaemonSession:
    return DaemonSession(
        daemon,
        "a",
        poll_interval_s=0.01,
        policy_timeout_s=policy_timeout_s,
        policy_notices=True,
        contact_since=since or time.monotonic(),
    )


def test_a_policy_reply_gives_this_nodes_topology() -> None:
    ring = topology_of(_reply(7, _ring(topology_epoch=5)), "a")
    assert ring is not None and ring.kind == "ring" and ring.ring_order == ("a", "c", "b")
    assert ring.epoch == 5 and topology_epoch(_reply(7, _ring(topology_epoch=5))) == 5
    assert topology_epoch(_reply(7, _ring())) == 7  # 0: the epoch of the reply
    tree = SyncPolicyWire(kind="tree", nodes=["a", "b"], parents={"a": None, "b": "a"},
                          addresses=ADDRS)  # fmt: skip
    topo = topology_of(_reply(3, tree), "b")
    assert topo is not None and topo.kind == "tree" and topo.epoch == 3
    alone = topology_of(_reply(2, SyncPolicyWire(kind="single", nodes=["a"])), "a")
    assert alone is not None and alone.ring_order == ("a",)
    assert topology_of(_reply(7, _ring()), "z") is None  # not a member
    assert topology_of(_reply(7, _ring(connected=False)), "a") is None  # split overlay
    assert topology_of(_reply(7, None), "a") is None


def test_poll_returns_only_a_newer_unpaused_policy_that_includes_this_node() -> None:
    session = _session(FakeDaemon([_reply(4, _ring())]))
    p = session.poll(installed_epoch=3)
    assert p is not None and p.epoch == 4 and p.members == ("a", "b", "c") and p.topology
    assert session.poll(installed_epoch=4) is None
    paused = _session(FakeDaemon([_reply(5, _ring(), paused=True)]))
    assert paused.poll(installed_epoch=4) is None
    outside = _session(FakeDaemon([_reply(5, None)]))
    assert outside.poll(installed_epoch=4) is None


def test_a_slow_daemon_is_tolerated_until_it_is_silent_for_the_policy_timeout() -> None:
    slow = _session(FakeDaemon([ChaosTimeout("slow")]), policy_timeout_s=10.0)
    assert slow.poll(installed_epoch=3) is None  # keeps the current policy
    silent = _session(FakeDaemon([ChaosTimeout("slow")]), 0.5, since=time.monotonic() - 1.0)
    with pytest.raises(TrainingStalled, match="did not answer"):
        silent.poll(installed_epoch=3)


def test_wait_asks_until_the_condition_holds_and_times_out_otherwise() -> None:
    daemon = FakeDaemon([ChaosTimeout("slow"), _reply(2, _ring(), paused=True), _reply(3, _ring())])
    session = _session(daemon)
    assert session.wait(lambda p: p.epoch >= 2, 5.0, "epoch 2").epoch == 3  # not the paused one
    with pytest.raises(ChaosTimeout, match="waiting for epoch 9"):
        session.wait(lambda p: p.epoch >= 9, 0.1, "epoch 9")


def test_reports_neighbours_and_close() -> None:
    daemon = FakeDaemon([_reply(1, _ring())])
    session = _session(daemon)
    session.report_step_failed("b", epoch=1)  # refused: best effort, no exception
    session.report_ready(0.5, "epoch 1 step 0")
    assert daemon.events == [("ready", "epoch 1 step 0", 0)]
    assert session.neighbors() == ["b", "c"]
    session.close()
    assert daemon.closed
