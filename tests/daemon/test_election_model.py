"""A Raft-style safety and liveness check of the scheduler's election and quorum rules.

A small cluster model (4 nodes, discrete time, a bag of messages in flight) drives the daemon's
pure rules: :class:`~chaos.daemon.election.Election` (terms, votes, stickiness, timeouts),
:func:`~chaos.daemon.election.carried_silence` (the former scheduler's silence a new one
carries), :class:`~chaos.daemon.scheduler.quorum.QuorumBase` (the quorum base and settling) and
:class:`~chaos.daemon.scheduler.failures.FailureDetector` (silences, quorum loss, one removal per
commit). Hypothesis picks the sequence of heartbeats, message deliveries and losses, crashes,
graceful leaves and election timeouts. The I/O around the rules (sockets, the view rebuild, the
trainers) is not modelled: a new scheduler commits its ``reelection`` epoch at once.

Invariants, checked after every step:

* at most one scheduler commits in a term;
* committed views are totally ordered: no two different views of the same epoch are each
  installed by a majority of their members.

Without message loss, with at most one crash and one graceful leave among four nodes (the live
members always a majority of what is left), the cluster must also stay live: no scheduler loses
its quorum, no live member is failed, and in the end exactly one scheduler, unpaused, is followed
by every live member. ``test_the_model_finds_the_old_rules`` shows the check failing on the
previous rules (a quorum base that kept a leaver until a majority of the old membership
acknowledged its removal; a former scheduler failed at once even when it had just voted).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pytest
from chaos.daemon.config import DaemonConfig
from chaos.daemon.election import Election, carried_silence
from chaos.daemon.scheduler.failures import FailureDetector
from chaos.daemon.scheduler.quorum import QuorumBase, majority_acked
from chaos.daemon.states import Role
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.protocol import RequestVote, VoteReply

IDS = ("n0", "n1", "n2", "n3")
HB_S = 0.1
CFG = DaemonConfig(
    node_id="n0",
    listen="tcp://127.0.0.1:7000",
    heartbeat_interval_s=HB_S,
    failure_timeout_s=0.5,
    election_timeout_min_s=0.5,
    election_timeout_max_s=1.0,
)


@dataclass(frozen=True)
class View:
    """A committed membership: its epoch, the term and scheduler that committed it."""

    epoch: int
    term: int
    scheduler: str
    members: frozenset[str]


@dataclass
class Msg:
    """A message in flight."""

    src: str
    dst: str
    kind: str  # hb, upd, ack, mhb, leave, stale, rv, vr
    term: int = 0
    epoch: int = 0
    view: View | None = None
    body: RequestVote | VoteReply | None = None


class OldQuorumBase(QuorumBase):
    """The previous rule: the base moved only once a majority of it and of the new membership
    acknowledged the new epoch (a leaver stayed in it until then)."""

    def __init__(self, members: Iterable[str]) -> None:
        super().__init__(members)
        self.stable = frozenset(members)

    def committed(self, epoch: int, members: Iterable[str]) -> None:
        self.unsettled[epoch] = frozenset(members)

    def settle(self, acked: Mapping[str, int]) -> list[int]:
        done = []
        for e in sorted(self.unsettled):
            new = self.unsettled[e]
            if not (majority_acked(self.stable, acked, e) and majority_acked(new, acked, e)):
                break
            self.stable = self.members = new
            del self.unsettled[e]
            done.append(e)
        return done


@dataclass
class Sched:
    """The pure parts of a scheduler role."""

    members: set[str]
    epoch: int
    quorum: QuorumBase
    detector: FailureDetector
    acked: dict[str, int] = field(default_factory=dict)


class Model:
    """Four nodes running the election and quorum rules over a lossy bag of messages."""

    def __init__(self, seed: int, old_quorum: bool = False, old_carry: bool = False) -> None:
        self.now = 0.0
        self.old_quorum = old_quorum
        self.old_carry = old_carry
        self.msgs: list[Msg] = []
        self.alive = set(IDS)
        self.gone: set[str] = set()  # left, or dropped from the view while alive
        self.leaving: set[str] = set()
        self.isolated: set[str] = set()  # every message to or from these is lost
        first = View(1, 1, "n0", frozenset(IDS))
        self.view = dict.fromkeys(IDS, first)
        self.elections = {n: Election(n, CFG, random.Random(f"{seed}-{n}")) for n in IDS}
        self.prev: dict[str, tuple[str, float] | None] = dict.fromkeys(IDS)
        self.sched: dict[str, Sched] = {}
        self.committers: dict[int, set[str]] = {}
        self.installed: dict[tuple[int, View], set[str]] = {}
        self.quorum_lost: list[str] = []
        self.live_failed: list[str] = []
        for n, e in self.elections.items():
            e.term = 1
            e.on_scheduler(1, "n0", 0.0) if n != "n0" else e.become_scheduler(0.0)
        self.sched["n0"] = self._role("n0", None)
        for n in IDS:
            self.installed.setdefault((1, first), set()).add(n)

    # -- the scheduler ----------------------------------------------------------------------

    def _role(self, node: str, silent: tuple[str, float] | None) -> Sched:
        v = self.view[node]
        base = OldQuorumBase(v.members) if self.old_quorum else QuorumBase(v.members)
        det = FailureDetector(node, CFG, v.members, self.now)
        if silent is not None and silent[0] in det.last_heard:
            det.heard(silent[0], silent[1])
        return Sched(set(v.members), v.epoch, base, det)

    def _commit(self, node: str) -> None:
        s, term = self.sched[node], self.elections[node].term
        s.epoch += 1
        view = View(s.epoch, term, node, frozenset(s.members))
        s.quorum.committed(s.epoch, view.members)
        self.committers.setdefault(term, set()).add(node)
        for m in sorted(view.members):
            self.msgs.append(Msg(node, m, "upd", term, view.epoch, view))

    def _become(self, node: str) -> None:
        e = self.elections[node]
        prev = self.prev[node]
        silent = prev if self.old_carry else carried_silence(prev, e.heard)
        e.become_scheduler(self.now)
        self.prev[node] = None
        self.sched[node] = self._role(node, silent)
        if not self._check_failures(node):  # at once, as the daemon's timer does
            self._commit(node)  # the reelection epoch

    def _drop_role(self, node: str) -> None:
        s = self.sched.pop(node, None)
        if s is not None:
            self.elections[node].issued(s.epoch)

    def _check_failures(self, node: str) -> bool:
        """The scheduler's failure check; ``True`` if it paused or committed a removal."""
        s = self.sched[node]
        verdict = s.detector.check(sorted(s.members), s.quorum.members, True, self.now)
        if verdict.quorum_lost:
            self.quorum_lost.append(node)
            self._drop_role(node)
            self.elections[node].step_down(self.elections[node].term, self.now)
            return True
        if verdict.failed and not s.quorum.settling:
            peer = verdict.failed[0]
            if peer in self.alive and peer not in self.gone:
                self.live_failed.append(peer)
            s.members.discard(peer)
            s.detector.forget(peer)
            self._commit(node)
            return True
        return False

    # -- steps ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Time moves one heartbeat; every live node does its periodic work."""
        self.now += HB_S
        for n in IDS:
            if n not in self.alive or n in self.gone:
                continue
            e = self.elections[n]
            if n in self.sched:
                s = self.sched[n]
                for m in sorted(s.members - {n}):
                    self.msgs.append(Msg(n, m, "hb", e.term))
                self._check_failures(n)
            elif n in self.leaving:
                if e.scheduler is not None:
                    self.msgs.append(Msg(n, e.scheduler, "leave", e.term))
            elif e.scheduler is not None:
                self.msgs.append(Msg(n, e.scheduler, "mhb", e.term))
            if n not in self.sched and n not in self.leaving and self.now >= e.deadline:
                self._start_election(n)

    def _start_election(self, n: str) -> None:
        e, v = self.elections[n], self.view[n]
        if n not in v.members:
            e.disarm()
            return
        if e.scheduler is not None or self.prev[n] is None:
            known = e.scheduler or v.scheduler
            if known != n:
                self.prev[n] = (known, e.last_scheduler_contact)
        rv = e.start(self.now, v.epoch)
        if e.has_majority(v.members):
            self._become(n)
            return
        for m in sorted(v.members - {n}):
            self.msgs.append(Msg(n, m, "rv", body=rv))

    def crash(self, n: str) -> None:
        self.alive.discard(n)
        self._drop_role(n)

    def leave(self, n: str) -> None:
        if n in self.alive and n not in self.gone and n not in self.sched:
            self.leaving.add(n)
            self.elections[n].disarm()

    def deliver(self, i: int, lose: bool = False) -> None:
        msg = self.msgs.pop(i % len(self.msgs))
        cut = msg.src in self.isolated or msg.dst in self.isolated
        if lose or cut or msg.dst not in self.alive or msg.dst in self.gone:
            return
        getattr(self, f"_on_{msg.kind}")(msg)

    def flush(self, order: random.Random) -> None:
        """Delivers every message in flight (and those they cause), in a random order."""
        for _ in range(10_000):
            if not self.msgs:
                return
            self.deliver(order.randrange(len(self.msgs)))
        raise AssertionError("messages never settle")

    # -- handlers ---------------------------------------------------------------------------

    def _from_scheduler(self, msg: Msg) -> bool:
        """A scheduler's heartbeat or update: follow it unless its term is stale."""
        n, e = msg.dst, self.elections[msg.dst]
        if msg.src == n:
            return True
        if msg.term < e.term:
            self.msgs.append(Msg(n, msg.src, "stale", e.term))
            return False
        if n in self.sched and msg.term <= e.term:
            return False
        self._drop_role(n)
        e.on_scheduler(msg.term, msg.src, self.now)
        if n in self.leaving:
            e.disarm()
        return True

    def _on_hb(self, msg: Msg) -> None:
        self._from_scheduler(msg)

    def _on_upd(self, msg: Msg) -> None:
        n, view = msg.dst, msg.view
        if view is None or not self._from_scheduler(msg) or view.epoch < self.view[n].epoch:
            return
        self.view[n] = view
        self.installed.setdefault((view.epoch, view), set()).add(n)
        if n not in view.members:
            self.gone.add(n)
            return
        if n not in self.leaving:
            self.msgs.append(Msg(n, msg.src, "ack", self.elections[n].term, view.epoch))

    def _on_ack(self, msg: Msg) -> None:
        s = self.sched.get(msg.dst)
        if s is None:
            return
        s.detector.heard(msg.src, self.now)
        s.acked[msg.src] = max(s.acked.get(msg.src, 0), msg.epoch)
        s.quorum.settle(s.acked)

    def _on_mhb(self, msg: Msg) -> None:
        s = self.sched.get(msg.dst)
        if s is not None and msg.src in s.members:
            s.detector.heard(msg.src, self.now)

    def _on_leave(self, msg: Msg) -> None:
        s = self.sched.get(msg.dst)
        if s is None:
            return
        if msg.src in s.members:
            s.members.discard(msg.src)
            s.detector.forget(msg.src)
            self._commit(msg.dst)
        # the leave's answer: the view without the leaver
        v = View(s.epoch, self.elections[msg.dst].term, msg.dst, frozenset(s.members))
        self.msgs.append(Msg(msg.dst, msg.src, "upd", v.term, v.epoch, v))

    def _on_stale(self, msg: Msg) -> None:
        e = self.elections[msg.dst]
        if msg.term > e.term:
            self._drop_role(msg.dst)
            e.step_down(msg.term, self.now)

    def _on_rv(self, msg: Msg) -> None:
        n, e = msg.dst, self.elections[msg.dst]
        if not isinstance(msg.body, RequestVote) or msg.src not in self.view[n].members:
            return  # validation: not a member of this node's view
        if n in self.sched:
            e.issued(self.sched[n].epoch)
        reply = e.on_request_vote(msg.body, self.now, self.view[n].epoch)
        if e.role != Role.SCHEDULER:
            self._drop_role(n)
        if n in self.leaving:
            e.disarm()
        self.msgs.append(Msg(n, msg.src, "vr", body=reply))

    def _on_vr(self, msg: Msg) -> None:
        n, e = msg.dst, self.elections[msg.dst]
        if not isinstance(msg.body, VoteReply):
            return
        s = self.sched.get(n)
        if s is not None and msg.src in s.detector.last_heard:
            s.detector.heard(msg.src, self.now)  # a late reply: its sender is alive
        if e.on_vote_reply(msg.body, self.now, self.view[n].members):
            self._become(n)
        elif e.role != Role.SCHEDULER:
            self._drop_role(n)

    # -- invariants -------------------------------------------------------------------------

    def check_safety(self) -> None:
        for term, who in self.committers.items():
            assert len(who) <= 1, f"term {term} has two committing schedulers: {who}"
        committed: dict[int, View] = {}
        for (epoch, view), nodes in self.installed.items():
            if 2 * len(nodes & view.members) > len(view.members):
                other = committed.setdefault(epoch, view)
                assert other == view, f"epoch {epoch} committed twice: {other} and {view}"

    def live_members(self) -> set[str]:
        return self.alive - self.gone


_LOSS = st.sampled_from([0, 0, 5, 20, 50, 100])
_STEP = st.one_of(
    st.tuples(st.just("run"), st.integers(1, 10), _LOSS),
    st.tuples(st.just("tick"), st.integers(1, 8), st.just(0)),
    st.tuples(st.just("deliver"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("crash"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("leave"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("isolate"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("heal"), st.just(0), st.just(0)),
)


def _step(m: Model, kind: str, a: int, b: int, rng: random.Random) -> None:
    """One step: ``run`` delivers what is in flight (losing ``b`` percent) then ticks, ``a``
    times; ``tick`` only ticks; ``deliver`` delivers (or, with ``b``, loses) one message."""
    if kind in ("run", "tick"):
        for _ in range(a):
            for _ in range(len(m.msgs) if kind == "run" else 0):
                if m.msgs:
                    m.deliver(rng.randrange(len(m.msgs)), lose=rng.randrange(100) < b)
            m.tick()
    elif kind == "deliver" and m.msgs:
        m.deliver(a, lose=bool(b))
    elif kind == "crash" and len(IDS) - len(m.alive) < 2:
        m.crash(IDS[a])
    elif kind == "leave":
        m.leave(IDS[a])
    elif kind == "isolate":
        m.isolated.add(IDS[a])
    elif kind == "heal":
        m.isolated.clear()


@settings(max_examples=1000)
@given(seed=st.integers(0, 2**16), steps=st.lists(_STEP, min_size=10, max_size=150))
def test_one_scheduler_per_term_and_committed_epochs_totally_ordered(
    seed: int, steps: list[tuple[str, int, int]]
) -> None:
    """Random heartbeats, deliveries, losses, crashes, leaves and elections keep Raft's safety."""
    m = Model(seed)
    rng = random.Random(seed)
    for kind, a, b in steps:
        _step(m, kind, a, b, rng)
        m.check_safety()
    m.isolated.clear()
    for _ in range(100):  # the faults stop; safety must hold while it settles
        m.flush(rng)
        m.tick()
        m.check_safety()


def _run_live(
    seed: int,
    crash_at: int,
    crash: int,
    leave_at: int,
    leave: int,
    *,
    old_quorum: bool = False,
    old_carry: bool = False,
    pause_ok: bool = False,
) -> None:
    """One crash and one leave at the given ticks, every message delivered before each tick."""
    m = Model(seed, old_quorum=old_quorum, old_carry=old_carry)
    order = random.Random(seed)
    for t in range(200):  # 20 s of model time
        if t == crash_at:
            m.crash(IDS[crash])
        if t == leave_at:
            m.leave(IDS[leave])
        m.flush(order)
        m.tick()
        m.check_safety()
        if not pause_ok:
            assert not m.quorum_lost, f"quorum lost with a live majority: {m.quorum_lost}"
        assert not m.live_failed, f"live members failed: {m.live_failed}"
    m.flush(order)
    live = m.live_members()
    scheds = [n for n in live if n in m.sched]
    assert len(scheds) == 1, f"schedulers {scheds} among {live}"
    assert all(m.elections[n].scheduler == scheds[0] for n in live), "not all follow it"
    assert live <= m.sched[scheds[0]].members | m.leaving


_LIVE = {
    "seed": st.integers(0, 2**16),
    "crash_at": st.integers(0, 30),
    "crash": st.integers(0, 3),
    "leave_at": st.integers(0, 30),
    "leave": st.integers(0, 3),
}


@settings(max_examples=300)
@given(**_LIVE)
def test_one_crash_and_one_leave_keep_the_cluster_live(
    seed: int, crash_at: int, crash: int, leave_at: int, leave: int
) -> None:
    """Without message loss, a crash and a leave among four nodes leave one working scheduler."""
    _run_live(seed, crash_at, crash, leave_at, leave)


@settings(max_examples=300)
@given(**_LIVE)
def test_a_paused_scheduler_is_not_failed_by_its_successor(
    seed: int, crash_at: int, crash: int, leave_at: int, leave: int
) -> None:
    """With the old quorum base the scheduler pauses; its successor must not fail it (it voted
    or stood: it is alive), and the cluster must recover with one scheduler."""
    _run_live(seed, crash_at, crash, leave_at, leave, old_quorum=True, pause_ok=True)


@pytest.mark.parametrize(
    ("old_quorum", "old_carry", "pause_ok", "found"),
    [
        (True, False, False, "quorum lost with a live majority"),
        (True, True, True, "live members failed"),
    ],
)
def test_the_model_finds_the_old_rules(
    old_quorum: bool, old_carry: bool, pause_ok: bool, found: str
) -> None:
    """The checks can fail: each previous rule, restored in the model, is found."""

    @settings(max_examples=300)
    @given(**_LIVE)
    def old(seed: int, crash_at: int, crash: int, leave_at: int, leave: int) -> None:
        _run_live(
            seed,
            crash_at,
            crash,
            leave_at,
            leave,
            old_quorum=old_quorum,
            old_carry=old_carry,
            pause_ok=pause_ok,
        )

    with pytest.raises(AssertionError, match=found):
        old()


def test_a_crash_right_after_a_leave_is_committed() -> None:
    """The campaign's case: n3 leaves, n1 dies before acknowledging; n0 and n2 go on."""
    m = Model(1)
    m.leave("n3")
    m.crash("n1")
    order = random.Random(1)
    for _ in range(50):
        m.flush(order)
        m.tick()
        m.check_safety()
    assert not m.quorum_lost and not m.live_failed
    assert "n0" in m.sched and m.sched["n0"].members == {"n0", "n2"}
    assert m.view["n2"].members == frozenset({"n0", "n2"})


def test_a_former_scheduler_votes_with_the_epoch_it_committed() -> None:
    """A scheduler that committed an epoch and paused before installing it must not vote for a
    candidate without that epoch: the candidate would commit the same epoch again, with another
    view (a schedule the random search found when votes compared the installed epoch only)."""
    m = Model(1)
    steps = [("tick", 1, 0)] * 3 + [("run", 4, 0), ("tick", 4, 0), ("crash", 1, 0)]
    steps += [("run", 7, 0), ("deliver", 0, 0), ("deliver", 1, 0), ("tick", 6, 0)]
    rng = random.Random(1)
    for kind, a, b in steps:
        _step(m, kind, a, b, rng)
        m.check_safety()
    for _ in range(100):
        m.flush(rng)
        m.tick()
        m.check_safety()
    e = Election("x", CFG, random.Random(0))
    e.issued(3)
    reply = e.on_request_vote(RequestVote(sender="y", epoch=2, term=1), 10.0, 2)
    assert not reply.granted


def test_a_hopeless_candidate_does_not_hold_back_the_member_that_can_win() -> None:
    """Candidates without the newest epoch stand in turn with ever higher terms; a member
    with that epoch denies them and must still time out and stand itself (a soak saw 9-16 s
    elections while each denied request restarted the one winner's timer)."""
    e = Election("x", CFG, random.Random(0))
    e.reset_deadline(0.0)
    deadline = e.deadline
    for term, t in ((2, 0.5), (3, 1.0), (4, 1.4)):
        reply = e.on_request_vote(RequestVote(sender="y", epoch=4, term=term), t, 5)
        assert not reply.granted and e.term == term
    assert e.deadline == deadline  # denied requests leave the timer alone
    granted = e.on_request_vote(RequestVote(sender="z", epoch=5, term=5), 1.5, 5)
    assert granted.granted and e.deadline > deadline  # a granted vote restarts it
