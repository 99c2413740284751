"""Who holds the scheduler role: elections run, the role taken, kept and given up.

:class:`Succession` applies the rules of :class:`~chaos.daemon.election.Election` with the
daemon's I/O. It sends the heartbeats (the scheduler's to every member, a member's to the
scheduler), starts elections when the timeout expires or a handover (``TimeoutNow``) asks,
counts votes, builds the :class:`~chaos.daemon.scheduler.role.SchedulerRole` when this node wins,
and drops it when another scheduler, a higher term or a lost majority says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

from chaos.daemon.agent import Agent
from chaos.daemon.config import DaemonConfig
from chaos.daemon.election import Election, carried_silence
from chaos.daemon.facts import MemberFacts
from chaos.daemon.metrics import Metrics
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.scheduler.role import SchedulerHost, SchedulerRole
from chaos.daemon.states import DaemonState, Role
from chaos.daemon.timers import Timers
from chaos.daemon.transport import ReplyPath, Transport
from chaos.daemon.vote_certs import VoteBook

from chaos.protocol import (
    MAX_COUNTER,
    ClusterView,
    LeaveRequest,
    MemberHeartbeat,
    Message,
    RequestVote,
    SchedulerHeartbeat,
    TimeoutNow,
    Vote,
    VoteReply,
    encode,
)

log = logging.getLogger(__name__)

class SuccessionHost(MemberFacts, SchedulerHost, Protocol):
    """What the succession needs from the daemon (and what the scheduler role it builds does)."""

    cfg: DaemonConfig

    @property
    def view(self) -> ClusterView | None: ...  # noqa: D102

    def members(self) -> list[str]: ...  # noqa: D102

    def to_scheduler(self, msg: Message) -> bool: ...  # noqa: D102


class Succession:
    """This node's part in choosing the scheduler, and the scheduler role when it holds it.

    Args:
        host: The daemon.
        election: The election rules and state.
        transport: Sends to the members.
        timers: The loop's timers (a new scheduler announces itself at once).
        agent: This node's resources and its report to a new scheduler.
        trainer: The local trainer's registration, reported to a new scheduler.
        metrics: The state gauges, updated every heartbeat.
        leave_request: This node's leave in flight, if leaving (asked anew of a new scheduler).
        votes: The signed votes it gives and wins with (:mod:`chaos.daemon.vote_certs`).
    """

    def __init__(
        self,
        host: SuccessionHost,
        election: Election,
        transport: Transport,
        timers: Timers,
        agent: Agent,
        trainer: TrainerRelay,
        metrics: Metrics,
        leave_request: Callable[[], LeaveRequest],
        votes: VoteBook,
    ) -> None:
        self.host = host
        self.election = election
        self.transport = transport
        self.timers = timers
        self.agent = agent
        self.trainer = trainer
        self.metrics = metrics
        self.leave_request = leave_request
        self.votes = votes
        self.role: SchedulerRole | None = None
        self._prev_scheduler: tuple[str, float] | None = None

    def _drop(self) -> None:
        """Gives up the role, remembering the newest epoch it committed (votes compare with it)."""
        if self.role is not None:
            self.election.issued(self.role.epoch)
        self.role = None

    @property
    def is_scheduler(self) -> bool:
        """Whether this node is the scheduler."""
        return self.election.role == Role.SCHEDULER and self.role is not None

    @property
    def vote_cert(self) -> list[Vote]:
        """The signed votes this node won the current term with (empty: none, or no key)."""
        return self.votes.cert(self.election.term)

    def scheduler_problem(self, msg: Message) -> str | None:
        """Why a scheduler's message (heartbeat, update, command) is not taken from its
        sender (see :meth:`VoteBook.scheduler_problem`); ``None``: it is."""
        e = self.election
        return self.votes.scheduler_problem(msg, e.term, e.scheduler, e.voted_for, self.host.view)

    # -- heartbeats ------------------------------------------------------------------------

    def heartbeat(self, now: float) -> None:
        """The scheduler's heartbeat to every member, or a member's to the scheduler."""
        h = self.host
        if self.is_scheduler and self.role is not None:
            self.election.last_scheduler_contact = now
            self.role.on_heartbeat(h.node_id, self.agent.resources, now)
            frame = encode(SchedulerHeartbeat(sender=h.node_id, epoch=h.epoch, term=h.term,
                                              cert=self.vote_cert))  # fmt: skip
            for m in h.members():
                if m != h.node_id:
                    self.transport.send_peer(m, frame)
        elif h.state == DaemonState.ACTIVE and self.election.scheduler is not None:
            h.to_scheduler(
                MemberHeartbeat(
                    sender=h.node_id, epoch=h.epoch, term=h.term, resources=self.agent.resources
                )
            )
        self.metrics.state(h.epoch, h.term, len(h.members()), self.is_scheduler, h.paused)

    def on_scheduler_heartbeat(
        self, msg: SchedulerHeartbeat, reply: ReplyPath | None, now: float
    ) -> None:
        """Follows the scheduler that sent ``msg`` (unless this node is a newer scheduler)."""
        h = self.host
        if h.state != DaemonState.ACTIVE or msg.sender == h.node_id:
            return
        if self.is_scheduler and msg.term <= h.term:
            return  # a stale scheduler; our own heartbeats will make it step down
        was_scheduler = self.is_scheduler
        if self.election.on_scheduler(msg.term, msg.sender, now) or was_scheduler:
            self._drop()
            h.event("scheduler_changed", scheduler=msg.sender, term=msg.term)
            self._send_agent_report()

    def follow(self, term: int, scheduler: str, now: float) -> None:
        """Follows the scheduler whose update named a newer term or another scheduler."""
        h = self.host
        if self.is_scheduler:
            self._drop()
        self.election.on_scheduler(term, scheduler, now)
        h.event("scheduler_changed", scheduler=scheduler, term=term)
        if h.state == DaemonState.LEAVING:  # the old scheduler may have lost the request
            h.to_scheduler(self.leave_request())

    def _send_agent_report(self) -> None:
        h = self.host
        report = self.agent.report(h.view, h.address, self.trainer.report_fields())
        if report is not None:
            h.to_scheduler(report)

    # -- votes -----------------------------------------------------------------------------

    def on_request_vote(self, msg: RequestVote, reply: ReplyPath | None, now: float) -> None:
        """Answers a candidate (a scheduler that grants a higher term steps down)."""
        h = self.host
        if h.state not in (DaemonState.ACTIVE, DaemonState.LEAVING):
            return  # a leaving member still votes: its own leave may need the new scheduler
        was_scheduler = self.is_scheduler
        if self.role is not None:  # a handover's vote: compare with what it committed
            self.election.issued(self.role.epoch)
        answer = self.votes.grant(self.election.on_request_vote(msg, now, h.epoch), msg.sender)
        if was_scheduler and self.election.role != Role.SCHEDULER:
            self._drop()
            h.event("stepped_down", term=h.term)
        h.respond(reply, answer)

    def on_vote_reply(self, msg: VoteReply, reply: ReplyPath | None, now: float) -> None:
        """Counts a vote; takes the role on a majority."""
        was_scheduler = self.is_scheduler
        msg = self.votes.take(msg, self.host.view)  # a vote whose signature fails is no vote
        if self.role is not None and msg.sender in self.role.last_heard:
            self.role.failures.heard(msg.sender, now)  # a late reply: its sender is alive
        if self.election.on_vote_reply(msg, now, self.host.members()):
            self.become_scheduler(now)
        elif was_scheduler and self.election.role != Role.SCHEDULER:
            self._drop()
            self.host.event("stepped_down", term=self.host.term)

    def on_timeout_now(self, msg: TimeoutNow, reply: ReplyPath | None, now: float) -> None:
        """A leaving scheduler's handover: start an election at once."""
        # a leaving member takes the handover too: the scheduler that sent it is gone, and its
        # own leave (and anyone else's) needs a scheduler (see become_scheduler)
        state = self.host.state
        if state in (DaemonState.ACTIVE, DaemonState.LEAVING) and not self.is_scheduler:
            self.start_election(now, transfer=True)

    def start_election(self, now: float, transfer: bool = False) -> None:
        """Stands as a candidate (wins at once when it alone is a majority)."""
        h = self.host
        members = h.members()
        if h.node_id not in members:
            self.election.disarm()
            return
        if self.election.scheduler is not None or self._prev_scheduler is None:
            known = self.election.scheduler or (h.view.scheduler if h.view else None)
            if known is not None and known != h.node_id:
                self._prev_scheduler = (known, self.election.last_scheduler_contact)
        if self.election.term >= MAX_COUNTER:
            self.election.disarm()
            log.error("term %d is at the wire limit: this node stands no more", h.term)
            h.event("counter_limit", counter="term", value=h.term)
            return
        rv = self.election.start(now, h.epoch, transfer)
        self.votes.stand(self.election.term)
        h.event("election_started", term=h.term, transfer=transfer)
        if self.election.has_majority(members):
            self.become_scheduler(now)
            return
        frame = encode(rv)
        for m in members:
            if m != h.node_id:
                self.transport.send_peer(m, frame)

    # -- the role --------------------------------------------------------------------------

    def become_scheduler(self, now: float, bootstrap: bool = False) -> None:
        """Takes the scheduler role (``bootstrap``: of a new one-node cluster, term 1)."""
        h = self.host
        if bootstrap:
            self.election.term = 1
            self.votes.stand(1)
        former = self._prev_scheduler
        silent = carried_silence(former, self.election.heard)
        self.election.become_scheduler(now)
        view = None if bootstrap else h.view
        self.role = SchedulerRole(h, h.cfg, view, now, old_scheduler=silent)
        self.role.trainers.absorb(h.node_id, self.trainer.report_fields())
        self._prev_scheduler = None
        h.event(
            "elected",
            term=h.term,
            epoch=h.epoch,
            former=former[0] if former is not None else None,
            former_heard_s=_ago(now, silent[1]) if silent is not None else None,
        )
        self.timers.wake("heartbeat", now)  # announce at once
        self.timers.wake("failures", now)
        if h.state == DaemonState.LEAVING:  # its request went to the old scheduler: ask anew
            h.to_scheduler(self.leave_request())

    def lose_quorum(self, now: float) -> None:
        """The scheduler no longer hears a majority: step down and pause.

        The role is dropped at once, so a paused scheduler commits nothing more; it keeps its
        term and may vote for (or become) the next scheduler.
        """
        self._drop()
        self.election.step_down(self.election.term, now)
        self.host.event("paused", reason="no majority heard", term=self.host.term)

    def on_stale_term(self, term: int, now: float) -> None:
        """A peer refused this node's message for a higher ``term``: step down to it."""
        if self.is_scheduler:
            self.host.event("stepped_down", term=term)
        self._drop()
        self.election.step_down(term, now)

    def drop_role(self) -> None:
        """Forgets the role without an event (this node joins a cluster)."""
        self._drop()


def _ago(now: float, then: float) -> float | None:
    """Seconds since ``then`` (``None``: never)."""
    return now - then if math.isfinite(then) else None
