"""``chaos-bench fuzz --key-holder``: a key holder that never joined attacks a keyed cluster.

A real cluster of ``chaos-daemon`` processes is started on loopback with a fresh cluster key
(``--cluster-key``); once it has elected a scheduler, every daemon's ``status`` (scheduler,
term, epoch, every member's bound public key and address) and RSS are recorded. The attacker
is a ZeroMQ DEALER per daemon, a CURVE client with the cluster key and a *fresh* keypair: it
holds the key but was never admitted, so no node id is bound to its key. It sends well-formed
messages (the real :mod:`chaos.protocol` structs, encoded: they pass schema validation, so what
is tested is the semantic checks), each attack kind repeated every ``round_s`` for
``attack_s`` seconds (:data:`ATTACKS`, in this order):

* ``vote_forgery``: ``RequestVote`` and ``VoteReply`` with ``sender`` = a member ``b`` (and
  the non-member ``ghost``);
* ``boundary_counters``: terms and epochs at ``2**53 - 1``, one past it, at
  ``current + 2**20 + 1`` and just under the jump bound (``MAX_TERM_JUMP`` /
  ``MAX_EPOCH_JUMP``), from the scheduler's and ``b``'s ids;
* ``scheduler_member``: ``SchedulerHeartbeat`` and ``ClusterUpdate`` with ``sender`` = ``b``
  (a member that is not the scheduler), term = current + 1 and + 3; the update's view names
  the forger as scheduler, binds ``b`` to the attacker's public key and gives member ``c`` the
  attacker's address;
* ``command_forgery``: ``ConnectCommand`` and ``TimeoutNow`` from ``b`` and ``ghost``;
* ``refusal_forgery``: ``Refusal`` (``stale_term``) with a higher term from ``ghost``, ``b``
  and no sender (a ``stale_term`` refusal makes its receiver step down to that term);
* ``operator_commands``: ``LeaveCommand`` and ``LinkCommand`` from the non-member ``ghost``;
* ``scheduler_ghost``: as ``scheduler_member``, with ``sender`` = ``ghost`` (no member).

A ``control`` phase first sends nothing for ``attack_s``: a change it sees is the cluster's
own (an election under load), which makes the attacks' figures unreliable.

During each attack every daemon's ``status`` is read after each round; afterwards the bench
waits up to ``recover_timeout_s`` for a scheduler with a majority and reads them again. An
attack counts as **accepted** at a daemon (``accepted`` is the number of daemons) that, in
any of those reads, followed a forger (its scheduler was ``ghost`` or the forging member),
changed its scheduler or term, saw a member's bound public key or address change, lost or
gained a member, stopped answering, or exited. The cluster is **wedged** after an attack when
no daemon reports a scheduler with a majority (one of the members, which itself reports being
an unpaused scheduler) within ``recover_timeout_s``, or a daemon no longer answers. A cluster
whose membership, bindings or answers an attack changed is replaced by a fresh one for the
next attack. RSS is read at each cluster's start and after its last attack and a settle
(goal: within 10 %).

Last, ``trainer_future_epoch`` (:mod:`chaos.bench.fuzz_keyholder_trainer`) sends future-epoch
data-plane frames at a keyed trainer of its own.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from chaos.bench.fuzz_keyholder_trainer import TRAINER_ATTACK, run_trainer_attack
from chaos.errors import ChaosError, ConfigError, ProtocolError
from chaos.launch import (
    daemon_command,
    free_tcp_address,
    kill_and_reap,
    spawn_daemon,
    wait_until,
)
from chaos.protocol import codec
from chaos.protocol import messages as m
from chaos.security import ClusterKey, Security

__all__ = [
    "ALL_KINDS",
    "ATTACKS",
    "GHOST",
    "KeyHolderConfig",
    "Scene",
    "run_attack",
    "run_key_holder",
]

GHOST = "ghost"
"""The id the attacker claims that no member has."""
START_TIMEOUT_S = 90.0
"""Longest wait for a cluster to form (every daemon active, everyone sees everyone)."""
ANSWER_TIMEOUT_S = 3.0
"""Longest wait for one daemon's ``status``."""
SEND_TIMEOUT_S = 2.0
"""Longest wait for one forged frame to leave (a daemon that stops reading fills the queue)."""
HEARTBEAT_S = 0.5
"""The daemons' heartbeat interval (``--heartbeat-interval``; the default)."""
FAILURE_TIMEOUT_S = 2.5
"""The daemons' failure timeout (``--failure-timeout``): above the default 1.5 s (and below the
link failure timeout, 3 s), so that a machine under load does not hold elections of its own in
the middle of an attack."""
SETTLE_S = 2.0
"""Pause after a cluster formed, and after its last attack, before its RSS is read."""
RSS_TOLERANCE = 0.10
"""An RSS after the attacks within this fraction of the one before counts as back."""
_TOML = """\
bandwidth_probe_bytes = 262144
bandwidth_probe_chunk_bytes = 65536
resource_interval_s = 1.0
"""


@dataclass(frozen=True)
class KeyHolderConfig:
    """Settings of one key-holder run (``chaos-bench fuzz --key-holder`` maps onto it).

    Attributes:
        daemons: Daemons in the cluster (3 to 7; a majority survives one that leaves).
        attack_s: Seconds each attack kind lasts.
        round_s: Seconds between two rounds of an attack's frames.
        recover_timeout_s: Longest wait after an attack for a scheduler with a majority.
        attacks: The attack kinds to run, in :data:`ATTACKS` order.
    """

    daemons: int = 4
    attack_s: float = 3.0
    round_s: float = 0.3
    recover_timeout_s: float = 15.0
    attacks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 3 <= self.daemons <= 7:
            raise ConfigError(f"daemons must be 3 to 7, got {self.daemons!r}")
        if not self.round_s > 0 or not self.attack_s >= self.round_s:
            raise ConfigError(f"need 0 < round_s <= attack_s, got {self.round_s!r}, "
                              f"{self.attack_s!r}")  # fmt: skip
        if not self.recover_timeout_s > 0:
            raise ConfigError(f"recover_timeout_s must be positive: {self.recover_timeout_s!r}")
        unknown = set(self.attacks) - set(ALL_KINDS)
        if unknown:
            raise ConfigError(f"unknown attack kinds {sorted(unknown)}; known: {ALL_KINDS}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The attack kinds to run (all when none were named), in :data:`ALL_KINDS` order."""
        return tuple(k for k in ALL_KINDS if not self.attacks or k in self.attacks)


# ----------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class Seen:
    """One daemon's ``status`` as read once (``answered`` False: it did not answer)."""

    node: str
    answered: bool
    scheduler: str | None = None
    term: int = 0
    epoch: int = 0
    role: str = ""
    paused: bool = False
    bindings: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Member id -> (bound public key, address), as this daemon's view has them."""

    def to_json(self) -> dict[str, Any]:
        """The JSON record."""
        if not self.answered:
            return {"answered": False}
        return {
            "answered": True, "scheduler": self.scheduler, "term": self.term,
            "epoch": self.epoch, "role": self.role, "paused": self.paused,
            "members": {k: {"public_key": v[0], "address": v[1]}
                        for k, v in sorted(self.bindings.items())},
        }  # fmt: skip


def _seen(node: str, st: m.StatusReply) -> Seen:
    return Seen(
        node, True, st.scheduler, st.term, st.epoch, st.role, st.paused,
        {n.id: (n.public_key, n.address) for n in st.nodes},
    )  # fmt: skip


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


class KeyedCluster:
    """Real keyed daemons on loopback; :meth:`close` kills and reaps them all.

    Args:
        root: A directory of its own (key file, config, run directories).
        n: Daemons to start.
    """

    def __init__(self, root: Path, n: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.key_path = ClusterKey.generate().write(root / "cluster.key")
        self.key = ClusterKey.load(self.key_path)
        self.probe = Security(self.key)  # a key holder of its own, for status only
        self.ids = [f"n{i}" for i in range(1, n + 1)]
        self.addrs: dict[str, str] = {}
        self.procs: dict[str, Any] = {}
        self.status: dict[str, Any] = {}
        self.rss_before: dict[str, int] = {}

    def start(self) -> None:
        """Starts the daemons, each joining through the one before, and waits until they all
        see each other under one scheduler.

        Raises:
            ChaosTimeout: the cluster did not form within :data:`START_TIMEOUT_S`.
            ProcessExited: a daemon exited while it started.
        """
        config = self.root / "daemon.toml"
        config.write_text(_TOML)
        prev: str | None = None
        for node in self.ids:
            self.addrs[node] = free_tcp_address()
            argv = daemon_command(
                node, self.addrs[node], join=self.addrs[prev] if prev else None,
                neighbors=(prev,) if prev else (), config=config,
                heartbeat_interval_s=HEARTBEAT_S, failure_timeout_s=FAILURE_TIMEOUT_S,
                cluster_key=self.key_path,
            )  # fmt: skip
            run_dir = self.root / node
            self.procs[node] = spawn_daemon(argv, run_dir, log_level="WARNING")
            wait_until(
                self._active(node), START_TIMEOUT_S, f"{node} to become active",
                watch=self.procs, tolerate=(ChaosError, OSError),
            )  # fmt: skip
            prev = node
        what = "the cluster to agree on its members and scheduler"
        wait_until(lambda: self.stable(self.snapshot()), START_TIMEOUT_S, what, watch=self.procs)
        time.sleep(SETTLE_S)
        self.status = {k: v.to_json() for k, v in self.snapshot().items()}
        self.rss_before = {k: _rss(p.pid) for k, p in self.procs.items()}

    def _active(self, node: str) -> Callable[[], bool]:
        def active() -> bool:
            with self._client(node) as c:
                return bool(c.status().state == "active")

        return active

    def _client(self, node: str) -> Any:
        from chaos.daemon.client import DaemonClient

        return DaemonClient(self.addrs[node], timeout_s=ANSWER_TIMEOUT_S, security=self.probe)

    def read(self, node: str) -> Seen:
        """``node``'s status now (not answered when it exited or timed out)."""
        if self.procs[node].poll() is not None:
            return Seen(node, False)
        try:
            with self._client(node) as c:
                st = c.status()
        except (ChaosError, OSError):
            return Seen(node, False)
        return _seen(node, st) if isinstance(st, m.StatusReply) else Seen(node, False)

    def snapshot(self) -> dict[str, Seen]:
        """Every daemon's status now."""
        return {node: self.read(node) for node in self.ids}

    def exited(self) -> list[str]:
        """The daemons that exited."""
        return [k for k, p in self.procs.items() if p.poll() is not None]

    def leader(self, snap: dict[str, Seen]) -> str | None:
        """The scheduler a majority of the daemons follow, if it is a member that says it is an
        unpaused scheduler itself."""
        votes = Counter(s.scheduler for s in snap.values() if s.answered and s.scheduler)
        if not votes:
            return None
        sched, n = votes.most_common(1)[0]
        own = snap.get(sched)
        if n * 2 <= len(self.ids) or own is None or not own.answered:
            return None
        return sched if own.role == "scheduler" and not own.paused else None

    def stable(self, snap: dict[str, Seen]) -> bool:
        """Every daemon answers, all under one leader and term, and all see the same members."""
        if not all(s.answered for s in snap.values()) or self.leader(snap) is None:
            return False
        keys = {(s.scheduler, s.term, frozenset(s.bindings)) for s in snap.values()}
        return len(keys) == 1 and set(next(iter(snap.values())).bindings) == set(self.ids)

    def rss_record(self) -> dict[str, Any]:
        """RSS at the start and now, by daemon (an exited one is left out of the ratio)."""
        after = {k: _rss(p.pid) if p.poll() is None else 0 for k, p in self.procs.items()}
        ratios = {k: round(after[k] / b, 4) for k, b in self.rss_before.items()
                  if b and after.get(k)}  # fmt: skip
        top = max(ratios.values()) if ratios else None
        return {
            "before_bytes": self.rss_before, "after_bytes": after, "ratio": ratios,
            "max_ratio": top,
            "within_10pct": bool(ratios) and all(abs(r - 1) <= RSS_TOLERANCE
                                                 for r in ratios.values()),
        }  # fmt: skip

    def close(self) -> bool:
        """Kills and reaps every daemon; whether all are reaped."""
        procs = list(self.procs.values())
        kill_and_reap(procs, timeout_s=10.0)
        return all(p.poll() is not None for p in procs)


# ----------------------------------------------------------------------------- the attacker


class Attacker:
    """A key holder that never joined: one CURVE DEALER per daemon, with a fresh keypair.

    Args:
        key: The cluster key.
        addrs: Each daemon's control endpoint.
    """

    def __init__(self, key: ClusterKey, addrs: dict[str, str]) -> None:
        self.sec = Security(key)  # the cluster key, and a keypair no daemon has ever seen
        self.address = free_tcp_address()  # claimed for member c; nothing listens there
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socks: dict[str, zmq.Socket[bytes]] = {}
        for node, addr in addrs.items():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
            self.sec.client(s)
            s.connect(addr)
            self.socks[node] = s
        self.sent: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.send_timeouts = 0

    @property
    def public_key(self) -> str:
        """The attacker's CURVE public key."""
        return self.sec.public_key

    def reset(self) -> None:
        """Starts the counts of the next attack."""
        self.drain()
        self.sent, self.refusals, self.replies = Counter(), Counter(), Counter()
        self.send_timeouts = 0

    def send(self, node: str, msg: m.Message) -> None:
        """Sends ``msg`` (encoded) to ``node``."""
        self.sent[codec.tag_of(msg)] += 1
        try:
            self.socks[node].send(codec.encode(msg))
        except zmq.Again:
            self.send_timeouts += 1

    def drain(self) -> None:
        """Counts the replies that came (refusals by reason)."""
        for s in self.socks.values():
            while s.poll(0, zmq.POLLIN):
                raw = s.recv_multipart(zmq.NOBLOCK)[-1]
                try:
                    msg = codec.decode(raw, 1 << 24)
                except (ProtocolError, msgspec.DecodeError):
                    self.replies["undecodable"] += 1
                    continue
                if isinstance(msg, m.Refusal):
                    self.refusals[msg.reason.value] += 1
                else:
                    self.replies[codec.tag_of(msg)] += 1

    def close(self) -> None:
        """Closes the sockets."""
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()


# ----------------------------------------------------------------------------- the attacks


@dataclass(frozen=True)
class Scene:
    """What the attacker knows before an attack (a key holder may read ``status``).

    Attributes:
        nodes: Every daemon's id.
        scheduler: The scheduler's id.
        b: A member that is not the scheduler (the one impersonated).
        c: Another (whose address is forged).
        term: The highest term any daemon reported.
        epoch: The highest epoch any daemon reported.
        view: The scheduler's view of the members.
        links: The scheduler's view of the links.
        sync: The scheduler's synchronization policy.
        key: The attacker's public key.
        address: The address the attacker claims for ``c``.
    """

    nodes: tuple[str, ...]
    scheduler: str
    b: str
    c: str
    term: int
    epoch: int
    view: tuple[m.NodeInfo, ...]
    links: tuple[m.LinkInfo, ...]
    sync: m.SyncPolicyWire
    key: str
    address: str

    def forged_view(self, forger: str, term: int, epoch: int) -> m.ClusterView:
        """The view a forged update carries: ``forger`` the scheduler, ``b`` bound to the
        attacker's key, ``c`` at the attacker's address."""
        nodes = []
        for n in self.view:
            if n.id == self.b:
                n = msgspec.structs.replace(n, public_key=self.key)
            elif n.id == self.c:
                n = msgspec.structs.replace(n, address=self.address)
            nodes.append(n)
        return m.ClusterView(epoch=epoch, term=term, scheduler=forger, nodes=nodes,
                             links=list(self.links))  # fmt: skip


Frames = list[tuple[str, m.Message]]
"""One round of an attack: (daemon it goes to, message)."""


def _to_all(s: Scene, msgs: list[m.Message]) -> Frames:
    return [(node, msg) for msg in msgs for node in s.nodes]


def _scheduler_claims(s: Scene, forger: str) -> Frames:
    msgs: list[m.Message] = []
    for dt in (1, 3):
        t, e = s.term + dt, s.epoch + dt
        msgs.append(m.SchedulerHeartbeat(sender=forger, epoch=s.epoch, term=t))
        view = s.forged_view(forger, t, e)
        msgs.append(
            m.ClusterUpdate(sender=forger, epoch=e, term=t, view=view, sync=s.sync, cause="join")
        )
    return _to_all(s, msgs)


def _vote_forgery(s: Scene) -> Frames:
    msgs: list[m.Message] = []
    for sender in (s.b, GHOST):
        msgs += [
            m.RequestVote(sender=sender, epoch=s.epoch, term=s.term + 1),
            m.RequestVote(sender=sender, epoch=s.epoch, term=s.term + 3, transfer=True),
            m.VoteReply(sender=sender, epoch=s.epoch, term=s.term, granted=True),
            m.VoteReply(sender=sender, epoch=s.epoch, term=s.term + 1, granted=True),
        ]
    return _to_all(s, msgs)


def _boundary_counters(s: Scene) -> Frames:
    top = m.MAX_COUNTER
    terms = (top, top + 1, s.term + m.MAX_TERM_JUMP + 1, s.term + m.MAX_TERM_JUMP - 1)
    epochs = (top, top + 1, s.epoch + m.MAX_EPOCH_JUMP + 1, s.epoch + m.MAX_EPOCH_JUMP - 1)
    msgs: list[m.Message] = []
    for t in terms:
        msgs += [
            m.SchedulerHeartbeat(sender=s.scheduler, epoch=s.epoch, term=t),
            m.MemberHeartbeat(sender=s.b, epoch=s.epoch, term=t),
            m.RequestVote(sender=s.b, epoch=s.epoch, term=t),
            m.TimeoutNow(sender=s.scheduler, epoch=s.epoch, term=t),
        ]
    for e in epochs:
        view = s.forged_view(s.scheduler, s.term, e)
        msgs += [
            m.ClusterUpdate(sender=s.scheduler, epoch=e, term=s.term, view=view, sync=s.sync),
            m.ConnectCommand(sender=s.scheduler, epoch=e, term=s.term, peer=s.c, address=s.address),
            m.MemberHeartbeat(sender=s.b, epoch=e, term=s.term),
        ]
    return _to_all(s, msgs)


def _command_forgery(s: Scene) -> Frames:
    msgs: list[m.Message] = []
    for sender in (s.b, GHOST):
        msgs += [
            m.ConnectCommand(
                sender=sender, epoch=s.epoch, term=s.term, peer=s.c, address=s.address
            ),
            m.ConnectCommand(
                sender=sender,
                epoch=s.epoch,
                term=s.term + 1,
                peer=GHOST,
                address=s.address,
                measure_bandwidth=False,
            ),
            m.TimeoutNow(sender=sender, epoch=s.epoch, term=s.term),
            m.TimeoutNow(sender=sender, epoch=s.epoch, term=s.term + 1),
        ]
    return _to_all(s, msgs)


def _refusal_forgery(s: Scene) -> Frames:
    msgs: list[m.Message] = [
        m.Refusal(sender=sender, epoch=s.epoch, reason=m.Reason.STALE_TERM, term=s.term + dt,
                  scheduler=GHOST, ref_type=ref)
        for sender, dt, ref in ((GHOST, 1, "scheduler_heartbeat"), (s.b, 5, "cluster_update"),
                                ("", 2, "member_heartbeat"))
    ]  # fmt: skip
    return _to_all(s, msgs)


def _operator_commands(s: Scene) -> Frames:
    return [
        (s.c, m.LeaveCommand(sender=GHOST, epoch=s.epoch)),
        (s.b, m.LinkCommand(sender=GHOST, epoch=s.epoch, peer=s.scheduler, op="disconnect")),
        (s.scheduler, m.LinkCommand(sender=GHOST, epoch=s.epoch, peer=s.c, op="disconnect")),
    ]


ATTACKS: dict[str, Callable[[Scene], Frames]] = {
    "vote_forgery": _vote_forgery,
    "boundary_counters": _boundary_counters,
    "scheduler_member": lambda s: _scheduler_claims(s, s.b),
    "command_forgery": _command_forgery,
    "refusal_forgery": _refusal_forgery,
    "operator_commands": _operator_commands,
    "scheduler_ghost": lambda s: _scheduler_claims(s, GHOST),
}
"""Every attack kind at the daemons, in the order they run (the likeliest to damage the
cluster last)."""
ALL_KINDS = [*ATTACKS, TRAINER_ATTACK]
"""Every attack kind: those at the daemons, then future-epoch frames at a keyed trainer
(:mod:`chaos.bench.fuzz_keyholder_trainer`)."""


def _scene(c: KeyedCluster, snap: dict[str, Seen], attacker: Attacker) -> Scene:
    leader = c.leader(snap) or c.ids[0]
    others = [n for n in c.ids if n != leader]

    def status() -> m.StatusReply:
        with c._client(leader) as client:
            return client.status()

    # a daemon under load may miss one read: a few tries before the run gives up
    st = wait_until(
        status, 3 * ANSWER_TIMEOUT_S, f"{leader}'s status", tolerate=(ChaosError, OSError)
    )
    sync = st.sync or m.SyncPolicyWire(kind="single", nodes=list(c.ids))
    return Scene(
        nodes=tuple(c.ids), scheduler=leader, b=others[0], c=others[1],
        term=max(x.term for x in snap.values()), epoch=max(x.epoch for x in snap.values()),
        view=tuple(st.nodes), links=tuple(st.links), sync=sync,
        key=attacker.public_key, address=attacker.address,
    )  # fmt: skip


# ----------------------------------------------------------------------------- judging


def _events(c: KeyedCluster, node: str) -> list[dict[str, Any]]:
    from chaos.daemon.events import read_events

    path = c.root / node / f"events-{node}.jsonl"
    try:
        return read_events(path) if path.exists() else []
    except (OSError, ValueError):
        return []


def _judge(
    pre: dict[str, Seen], samples: list[dict[str, Seen]], forgers: set[str], exited: list[str]
) -> dict[str, Any]:
    """What the samples show against the status before the attack (see the module docstring)."""
    followed: set[str] = set()
    changed: set[str] = set()
    members: set[str] = set()
    bindings: dict[tuple[str, str, str], dict[str, Any]] = {}
    for snap in samples:
        for node, s in snap.items():
            p = pre[node]
            if not s.answered or not p.answered:
                continue
            if s.scheduler in forgers:
                followed.add(node)
            if (s.scheduler, s.term) != (p.scheduler, p.term):
                changed.add(node)
            if set(s.bindings) != set(p.bindings):
                members.add(node)
            for member, (key, addr) in s.bindings.items():
                old = p.bindings.get(member)
                if old is None:
                    continue
                for what, before, after in (("public_key", old[0], key), ("address", old[1], addr)):
                    if before != after and (node, member, what) not in bindings:
                        bindings[(node, member, what)] = {
                            "daemon": node, "member": member, "field": what,
                            "before": before, "after": after,
                        }  # fmt: skip
    last = samples[-1] if samples else pre
    silent = sorted(n for n, s in last.items() if not s.answered and n not in exited)
    by = {
        "followed_forger": sorted(followed),
        "scheduler_or_term_changed": sorted(changed),
        "bindings_changed": list(bindings.values()),
        "members_changed": sorted(members),
        "not_answering": silent,
        "exited": sorted(exited),
    }
    daemons = followed | changed | members | {b["daemon"] for b in bindings.values()}
    daemons |= set(silent) | set(exited)
    return {"accepted": len(daemons), "accepted_by": by}


def _recover(c: KeyedCluster, timeout_s: float, samples: list[dict[str, Seen]]) -> float | None:
    """Seconds until a scheduler with a majority answers again (``None``: not within
    ``timeout_s``); every status read on the way is appended to ``samples``."""
    start = time.monotonic()
    while True:
        snap = c.snapshot()
        samples.append(snap)
        live = [s for n, s in snap.items() if n not in c.exited()]
        if c.leader(snap) is not None and all(s.answered for s in live):
            return round(time.monotonic() - start, 2)
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(0.2)


def run_attack(
    c: KeyedCluster, attacker: Attacker, name: str, cfg: KeyHolderConfig
) -> dict[str, Any]:
    """Runs one attack kind (``control``: none) against a stable cluster and judges it.

    Args:
        c: The cluster (stable: see :meth:`KeyedCluster.stable`).
        attacker: The key holder.
        name: A key of :data:`ATTACKS`, or ``control``.
        cfg: The run's settings.

    Returns:
        The attack's JSON record; ``damaged`` says the cluster must be replaced.
    """
    pre = c.snapshot()
    scene = _scene(c, pre, attacker)
    frames = ATTACKS[name](scene) if name in ATTACKS else []
    marks = {n: len(_events(c, n)) for n in c.ids}
    attacker.reset()
    samples: list[dict[str, Seen]] = []
    rounds = 0
    end = time.monotonic() + cfg.attack_s
    while (t0 := time.monotonic()) < end:
        for node, msg in frames:
            if c.procs[node].poll() is None:
                attacker.send(node, msg)
        rounds += 1
        attacker.drain()
        samples.append(c.snapshot())
        attacker.drain()
        time.sleep(max(0.0, cfg.round_s - (time.monotonic() - t0)))
    recovered = _recover(c, cfg.recover_timeout_s, samples)
    time.sleep(SETTLE_S)  # then the check again after a settle
    post = c.snapshot()
    samples.append(post)
    attacker.drain()
    forgers = {GHOST, scene.b} if name != "control" else set()
    verdict = _judge(pre, samples, forgers, c.exited())
    by = verdict["accepted_by"]
    wedged = recovered is None or bool(by["not_answering"])
    events: Counter[str] = Counter()
    for node in c.ids:
        events.update(str(e.get("event")) for e in _events(c, node)[marks[node] :])
    return {
        "frames_sent": sum(attacker.sent.values()),
        "rounds": rounds,
        "frames_by_type": dict(sorted(attacker.sent.items())),
        "send_timeouts": attacker.send_timeouts,
        "refusals": dict(sorted(attacker.refusals.items())),
        "replies": dict(sorted(attacker.replies.items())),
        **verdict,
        "wedged": wedged,
        "recovered_after_s": recovered,
        "events": dict(sorted(events.items())),
        "scene": {
            "scheduler": scene.scheduler,
            "b": scene.b,
            "c": scene.c,
            "term": scene.term,
            "epoch": scene.epoch,
            "attacker_key": scene.key,
            "attacker_address": scene.address,
        },
        "before": {k: v.to_json() for k, v in pre.items()},
        "after": {k: v.to_json() for k, v in post.items()},
        "damaged": wedged or bool(by["bindings_changed"] or by["members_changed"] or by["exited"]),
    }


# ----------------------------------------------------------------------------- the run


def run_key_holder(cfg: KeyHolderConfig, root: Path) -> dict[str, Any]:
    """Starts a keyed cluster, runs the control and every attack kind, and reports.

    Args:
        cfg: The run's settings.
        root: A directory for the clusters' files (key, config, run directories).

    Returns:
        The JSON record (see the module docstring).

    Raises:
        ChaosTimeout: a cluster did not form within :data:`START_TIMEOUT_S`.
        ProcessExited: a daemon exited while it started.
    """
    clusters: list[dict[str, Any]] = []
    records: dict[str, dict[str, Any]] = {}
    reaped = True
    cluster: KeyedCluster | None = None
    attacker: Attacker | None = None

    def finish() -> None:
        nonlocal cluster, attacker, reaped
        if attacker is not None:
            attacker.close()
        if cluster is not None:
            with contextlib.suppress(Exception):  # a record must not keep the daemons alive
                time.sleep(SETTLE_S)
                clusters[-1]["rss"] = cluster.rss_record()
            reaped = cluster.close() and reaped
        cluster, attacker = None, None

    try:
        for name in ("control", *(k for k in cfg.kinds if k in ATTACKS)):
            if cluster is not None and not _wait_stable(cluster, cfg.recover_timeout_s):
                finish()
            if cluster is None:
                cluster = KeyedCluster(root / f"cluster{len(clusters) + 1}", cfg.daemons)
                clusters.append({"status": {}, "pids": {}, "rss": None, "attacks": []})
                cluster.start()
                clusters[-1]["status"] = cluster.status
                clusters[-1]["pids"] = {k: p.pid for k, p in cluster.procs.items()}
                attacker = Attacker(cluster.key, cluster.addrs)
            if attacker is None:  # set with the cluster
                raise ChaosError("no attacker for the cluster")
            rec = run_attack(cluster, attacker, name, cfg)
            rec["cluster"] = len(clusters)
            clusters[-1]["attacks"].append(name)
            records[name] = rec
            if rec["damaged"]:
                finish()
    finally:
        finish()
    if TRAINER_ATTACK in cfg.kinds:
        key = ClusterKey.generate().write(root / "trainer.key")
        records[TRAINER_ATTACK] = run_trainer_attack(
            root / "trainer", key, cfg.attack_s, cfg.round_s
        )
    return _report(cfg, clusters, records, reaped)


def _wait_stable(c: KeyedCluster, timeout_s: float) -> bool:
    try:
        wait_until(lambda: c.stable(c.snapshot()), timeout_s, "a stable cluster")
    except ChaosError:
        return False
    return True


def _report(
    cfg: KeyHolderConfig,
    clusters: list[dict[str, Any]],
    records: dict[str, dict[str, Any]],
    reaped: bool,
) -> dict[str, Any]:
    control = records.pop("control", None)
    ratios = [c["rss"]["max_ratio"] for c in clusters if c["rss"] and c["rss"]["max_ratio"]]
    return {
        "mode": "key_holder",
        "daemons": cfg.daemons,
        "attack_s": cfg.attack_s,
        "round_s": cfg.round_s,
        "recover_timeout_s": cfg.recover_timeout_s,
        "frames_sent": sum(r["frames_sent"] for r in records.values()),
        "accepted": sum(r["accepted"] for r in records.values()),
        "wedged": sum(1 for r in records.values() if r["wedged"]),
        "control_clean": control is not None and control["accepted"] == 0
        and not control["wedged"],
        "rss_ratio_max": max(ratios) if ratios else None,
        "rss_within_10pct": bool(clusters) and all(c["rss"] and c["rss"]["within_10pct"]
                                                   for c in clusters),
        "clusters_started": len(clusters),
        "clusters": clusters,
        "control": control,
        "attacks": records,
        "reaped": reaped,
    }  # fmt: skip
