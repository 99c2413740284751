"""The trainer's daemon session on its own: policies read from replies, polled, waited for."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from chaos.errors import ChaosTimeout, ProtocolError
from chaos.protocol import (
    AnsweredEvent,
    NodeInfo,
    NodeState,
    PolicyReply,
    StatusReply,
    StepFailed,
    SyncPolicyWire,
    TrainerReady,
    TrainerRegister,
)
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

    def register(self, reg: object, timeout_s: float | None = None) -> object:
        return None  # the session's registration is not under test here

    def trainer_event(self, event: AnsweredEvent, timeout_s: float | None = None) -> object:
        if isinstance(event, StepFailed):
            raise ProtocolError("refused")
        if isinstance(event, TrainerReady):
            self.events.append(("ready", event.detail, event.epoch))
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
    session.report_ready(0.5, "epoch 1 step 0", 0)
    assert daemon.events == [("ready", "epoch 1 step 0", 0)]
    assert session.neighbors() == ["b", "c"]
    session.close()
    assert daemon.closed


class QueuedDaemon(FakeDaemon):
    """Refuses the first ``busy`` registrations ``overloaded`` (another joiner is entering)."""

    def __init__(self, busy: int) -> None:
        super().__init__([_reply(1, _ring())])
        self.busy = busy
        self.asked = 0

    def register(self, reg: object, timeout_s: float | None = None) -> object:
        from chaos.daemon.client import RequestRefused

        self.asked += 1
        if self.asked <= self.busy:
            raise RequestRefused("overloaded", "b is catching up; ask again once it has entered")
        return None


def test_a_joiner_waits_in_line_without_spending_its_join_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refusals ``overloaded`` (other joiners go first) do not count against the registration's
    own budget, up to ``queue_s``: past that the last refusal is raised; other refusals are not
    waited out at all."""
    from chaos.daemon.client import RequestRefused

    import chaos.trainer.session as session_mod

    monkeypatch.setattr(session_mod, "_RETRY_TOTAL_S", 1.0)
    monkeypatch.setattr(session_mod, "_BUSY_BACKOFF_S", 0.05)

    def register(daemon: FakeDaemon, queue_s: float | None) -> None:
        reg = TrainerRegister(data_address="tcp://x:1", shard_address="tcp://x:2",
                              has_state=False, catch_up=True)  # fmt: skip
        _session(daemon).register(reg, timeout_s=0.1, queue_s=queue_s)

    # 40 refusals x 0.05 s: well past the 1 s budget, admitted in the end
    daemon = QueuedDaemon(busy=40)
    register(daemon, None)
    assert daemon.asked == 41
    daemon = QueuedDaemon(busy=40)
    register(daemon, 60.0)
    assert daemon.asked == 41
    # without a queue allowance, or with one that the line outlasts, it gives up
    for queue_s in (0.0, 0.5):
        daemon = QueuedDaemon(busy=40)
        with pytest.raises(RequestRefused, match="overloaded"):
            register(daemon, queue_s)
        assert daemon.asked < 41


def test_config_takes_a_join_queue_timeout() -> None:
    from chaos.errors import ConfigError
    from chaos.trainer import TrainerConfig

    assert TrainerConfig().join_queue_timeout_s == 600.0
    assert TrainerConfig(join_queue_timeout_s=None).join_queue_timeout_s is None
    for bad in (0, -1.0, True, "600"):
        with pytest.raises(ConfigError, match="join_queue_timeout_s"):
            TrainerConfig(join_queue_timeout_s=bad)  # type: ignore[arg-type]


def test_a_ready_report_that_finds_no_scheduler_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer is in the policy when it reports ready; a report lost to an election or a
    partition must not end its training script (it did: ChaosTimeout out of update())."""
    import chaos.trainer.session as session_mod

    class Silent(FakeDaemon):
        def trainer_event(self, event: AnsweredEvent, timeout_s: float | None = None) -> object:
            raise ChaosTimeout("no answer from the daemon")

    monkeypatch.setattr(session_mod, "_RETRY_TOTAL_S", 0.3)
    monkeypatch.setattr(session_mod, "_ATTEMPT_S", 0.1)
    assert _session(Silent([_reply(4, _ring())])).report_ready(1.0, "epoch 4", 3) is False
    assert _session(FakeDaemon([_reply(4, _ring())])).report_ready(1.0, "epoch 4", 3) is True
