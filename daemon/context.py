"""The one context every part of the daemon works through: its facts and its ways out.

A flow or a collaborator gets a :class:`Context` and whatever other collaborator it calls by
name; nothing reaches back into the daemon that built it. The context holds:

* :class:`NodeFacts`: who this node is and where it stands (identity, lifecycle, term, installed
  view, the scheduler role while it holds it). Read by everyone; written only by the part that
  owns each fact: the lifecycle by the daemon and the join flow, the view by the view installer,
  the role by the succession.
* the :class:`~chaos.daemon.outbox.Outbox`: sends to peers, replies, the local queue;
* the :class:`~chaos.daemon.events.EventLog` (:meth:`Context.event` also logs the event);
* the loop's :class:`~chaos.daemon.timers.Timers` and the
  :class:`~chaos.daemon.metrics.Metrics`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from chaos.daemon.config import DaemonConfig
from chaos.daemon.election import Election
from chaos.daemon.events import EventLog
from chaos.daemon.metrics import Metrics
from chaos.daemon.outbox import Outbox
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.states import DAEMON_TRANSITIONS, DaemonState, Role
from chaos.daemon.timers import Timers
from chaos.daemon.transport import ReplyPath
from chaos.daemon.vote_certs import VoteBook

from chaos.errors import ChaosError
from chaos.protocol import ClusterUpdate, ClusterView, Message, OpResult, Reason, Vote

log = logging.getLogger("chaos.daemon")


class HeldRole(Protocol):
    """What the facts read of the scheduler role: the epoch it committed last and its cluster
    monitor. The role itself (:class:`chaos.daemon.scheduler.role.SchedulerRole`) is built on
    this context, so the context names only this much of it; the member side's flows see the
    whole role (``Context[SchedulerRole]``), the scheduler's modules need none of it."""

    monitor: ClusterMonitor

    @property
    def epoch(self) -> int:
        """The epoch committed last."""


R = TypeVar("R", bound=HeldRole)
"""The scheduler role's type, as the holder of a context sees it."""


class NodeFacts(Generic[R]):
    """Who this node is and where it stands.

    Args:
        cfg: The validated configuration.
        election: The election state (term, role, the scheduler followed).
        votes: The signed votes it gives and wins with.
        public_key: Its CURVE public key (empty: no key).
        incarnation: This process's nonce (a join names it).
    """

    def __init__(
        self,
        cfg: DaemonConfig,
        election: Election,
        votes: VoteBook,
        public_key: str = "",
        incarnation: str = "",
    ) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.address = cfg.listen
        self.election = election
        self.votes = votes
        self.public_key = public_key
        self.sign_key = votes.sign_key
        self.incarnation = incarnation
        self.state = DaemonState.STARTING
        self.exit_code = 0
        self.stopping = False
        """Set by :meth:`finish`: the loop ends after its current step."""
        self.view: ClusterView | None = None
        """The installed view (written by the view installer)."""
        self.update: ClusterUpdate | None = None
        """The installed update, with its policies (written by the view installer)."""
        self.role: R | None = None
        """The scheduler role while this node holds it (written by the succession)."""

    # -- the lifecycle ---------------------------------------------------------------------

    def set_state(self, state: DaemonState) -> None:
        """Moves the lifecycle to ``state``.

        Raises:
            ChaosError: ``DAEMON_TRANSITIONS`` does not allow the move.
        """
        if state != self.state and state not in DAEMON_TRANSITIONS[self.state]:
            raise ChaosError(f"daemon state {self.state.value} -> {state.value} not allowed")
        self.state = state

    def finish(self, code: int) -> None:
        """Stops the loop after its current step; the daemon exits with ``code``."""
        self.exit_code = code
        self.stopping = True
        self.state = DaemonState.STOPPED

    def drop_role(self) -> None:
        """Gives the scheduler role up, remembering the newest epoch it committed (votes
        compare with it)."""
        if self.role is not None:
            self.election.issued(self.role.epoch)
        self.role = None

    # -- what everyone reads ---------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The installed view's epoch (0 before any)."""
        return self.view.epoch if self.view is not None else 0

    @property
    def term(self) -> int:
        """The current election term."""
        return self.election.term

    @property
    def active(self) -> bool:
        """Whether this daemon is an active member."""
        return self.state == DaemonState.ACTIVE

    @property
    def paused(self) -> bool:
        """Whether this member pauses (no scheduler with a majority)."""
        return self.state == DaemonState.ACTIVE and self.election.paused

    @property
    def is_scheduler(self) -> bool:
        """Whether this node is the scheduler."""
        return self.election.role == Role.SCHEDULER and self.role is not None

    @property
    def scheduler(self) -> str | None:
        """The scheduler this node knows (itself while it schedules; ``None``: none)."""
        return self.node_id if self.is_scheduler else self.election.scheduler

    @property
    def vote_cert(self) -> list[Vote]:
        """The signed votes this node won the current term with (empty: none, or no key)."""
        return self.votes.cert(self.election.term)

    @property
    def scheduler_monitor(self) -> ClusterMonitor | None:
        """The scheduler role's cluster monitor (``None``: not the scheduler)."""
        return self.role.monitor if self.role is not None else None

    @property
    def membership_version(self) -> object:
        """Changes whenever the scheduler's membership may have (``None`` on a member)."""
        role = self.role
        return (role, role.monitor.version) if role is not None else None

    def members(self) -> list[str]:
        """Current membership (the scheduler's monitor, else the installed view)."""
        if self.role is not None:
            return self.role.monitor.members()
        return [n.id for n in self.view.nodes] if self.view is not None else []

    def scheduler_problem(self, msg: Message) -> str | None:
        """Why a scheduler's message (heartbeat, update, command) is not taken from its sender
        (see :meth:`VoteBook.scheduler_problem`); ``None``: it is. A joining node takes its
        admission as it comes: it has no view to check against yet."""
        if self.state == DaemonState.JOINING:
            return None
        e = self.election
        return self.votes.scheduler_problem(msg, e.term, e.scheduler, e.voted_for, self.view)

    def view_address(self, peer: str) -> str | None:
        """The control address of ``peer`` in the installed view (``None``: not in it)."""
        if self.view is None:
            return None
        return next((n.address for n in self.view.nodes if n.id == peer), None)


@dataclass(frozen=True)
class Context(Generic[R]):
    """The daemon's facts and ways out, handed to every flow and collaborator.

    Attributes:
        facts: Who this node is and where it stands.
        out: Sends to peers, answers, the local queue.
        events: The event log.
        timers: The loop's timers.
        metrics: The counters and gauges.
    """

    facts: NodeFacts[R]
    out: Outbox
    events: EventLog
    timers: Timers
    metrics: Metrics

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.facts.node_id

    @property
    def cfg(self) -> DaemonConfig:
        """The daemon's configuration."""
        return self.facts.cfg

    def event(self, name: str, **fields: object) -> None:
        """Writes an event to the JSONL log and to the ``logging`` module."""
        self.events.emit(name, **fields)
        log.info("%s %s %s", self.facts.node_id, name, fields if fields else "")

    def result(
        self, reply: ReplyPath | None, op_id: str, reason: Reason | None = None, detail: str = ""
    ) -> None:
        """Answers a client with an :class:`OpResult` (failed when ``reason`` is given)."""
        f = self.facts
        msg = OpResult(sender=f.node_id, epoch=f.epoch, op_id=op_id, ok=reason is None,
                       reason=reason, detail=detail)  # fmt: skip
        self.out.respond(reply, msg)

    def internal_error(self, where: str, what: str, exc: BaseException) -> None:
        """Counts and records an exception the loop survived (already logged with its
        traceback)."""
        self.metrics.error(where)
        self.events.emit(f"{where}_error", type=what, error=repr(exc)[:300])
