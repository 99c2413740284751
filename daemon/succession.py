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
import time
from collections.abc import Callable

import msgspec
from chaos.daemon.agent import Agent
from chaos.daemon.dispatch import Handler, scheduler_side
from chaos.daemon.election import carried_silence
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.scheduler.role import DaemonContext, SchedulerRole
from chaos.daemon.states import DaemonState, Role
from chaos.daemon.transport import ReplyPath, Transport

from chaos.protocol import (
    MAX_COUNTER,
    LeaveRequest,
    MemberHeartbeat,
    RequestVote,
    SchedulerHeartbeat,
    TimeoutNow,
    VoteReply,
    encode,
)

log = logging.getLogger(__name__)


class Succession:
    """This node's part in choosing the scheduler, and the scheduler role when it holds it.

    Args:
        ctx: The daemon's context (the election and the votes are in its facts; the role it
            takes is kept there too).
        transport: Sends the heartbeats and vote requests, encoded once, to the members.
        agent: This node's resources and its report to a new scheduler.
        trainer: The local trainer's registration, reported to a new scheduler.
        leave_request: This node's leave in flight, if leaving (asked anew of a new scheduler).
    """

    def __init__(
        self,
        ctx: DaemonContext,
        transport: Transport,
        agent: Agent,
        trainer: TrainerRelay,
        leave_request: Callable[[], LeaveRequest],
    ) -> None:
        self.ctx = ctx
        self.election = ctx.facts.election
        self.votes = ctx.facts.votes
        self.transport = transport
        self.timers = ctx.timers
        self.metrics = ctx.metrics
        self.agent = agent
        self.trainer = trainer
        self.leave_request = leave_request
        self._prev_scheduler: tuple[str, float] | None = None

    @property
    def role(self) -> SchedulerRole | None:
        """The scheduler role while this node holds it."""
        return self.ctx.facts.role

    def _drop(self) -> None:
        """Gives up the role (see :meth:`NodeFacts.drop_role`)."""
        self.ctx.facts.drop_role()

    @property
    def is_scheduler(self) -> bool:
        """Whether this node is the scheduler."""
        return self.ctx.facts.is_scheduler

    def handlers(self) -> dict[type, Handler]:
        """The election and succession flow: heartbeats both ways, votes, handovers."""
        return {
            SchedulerHeartbeat: self.on_scheduler_heartbeat,
            MemberHeartbeat: scheduler_side(
                self.ctx.facts, lambda role, m, r, t: role.on_heartbeat(m.sender, m.resources, t)
            ),
            RequestVote: self.on_request_vote,
            VoteReply: self.on_vote_reply,
            TimeoutNow: self.on_timeout_now,
        }

    # -- heartbeats ------------------------------------------------------------------------

    def heartbeat(self, now: float) -> None:
        """The scheduler's heartbeat to every member, or a member's to the scheduler."""
        f = self.ctx.facts
        if self.is_scheduler and self.role is not None:
            self.election.last_scheduler_contact = now
            self.role.on_heartbeat(f.node_id, self.agent.resources, now)
            frame = encode(SchedulerHeartbeat(sender=f.node_id, epoch=f.epoch, term=f.term,
                                              cert=f.vote_cert))  # fmt: skip
            for m in f.members():
                if m != f.node_id:
                    self.transport.send_peer(m, frame)
        elif f.state == DaemonState.ACTIVE and self.election.scheduler is not None:
            self.ctx.out.to_scheduler(MemberHeartbeat(
                sender=f.node_id, epoch=f.epoch, term=f.term, resources=self.agent.resources
            ))  # fmt: skip
        self.metrics.state(f.epoch, f.term, len(f.members()), self.is_scheduler, f.paused)

    def on_scheduler_heartbeat(
        self, msg: SchedulerHeartbeat, reply: ReplyPath | None, now: float
    ) -> None:
        """Follows the scheduler that sent ``msg`` (unless this node is a newer scheduler)."""
        h = self.ctx
        if h.facts.state != DaemonState.ACTIVE or msg.sender == h.node_id:
            return
        if self.is_scheduler and msg.term <= h.facts.term:
            return  # a stale scheduler; our own heartbeats will make it step down
        was_scheduler = self.is_scheduler
        if self.election.on_scheduler(msg.term, msg.sender, now) or was_scheduler:
            self._drop()
            h.event("scheduler_changed", scheduler=msg.sender, term=msg.term)
            self._send_agent_report()

    def follow(self, term: int, scheduler: str, now: float) -> None:
        """Follows the scheduler whose update named a newer term or another scheduler."""
        h = self.ctx
        if self.is_scheduler:
            self._drop()
        self.election.on_scheduler(term, scheduler, now)
        h.event("scheduler_changed", scheduler=scheduler, term=term)
        if h.facts.state == DaemonState.LEAVING:  # the old scheduler may have lost the request
            h.out.to_scheduler(self.leave_request())

    def _send_agent_report(self) -> None:
        h = self.ctx
        report = self.agent.report(h.facts.view, h.facts.address, self.trainer.report_fields())
        if report is not None:
            h.out.to_scheduler(report)

    # -- votes -----------------------------------------------------------------------------

    def on_request_vote(self, msg: RequestVote, reply: ReplyPath | None, now: float) -> None:
        """Answers a candidate (a scheduler that grants a higher term steps down). A request
        marked ``transfer`` skips the stickiness rule only when
        :meth:`Election.honours_transfer` says so."""
        h = self.ctx
        if msg.transfer and not self.election.honours_transfer(msg, h.facts.members()):
            h.event("transfer_ignored", peer=msg.sender, term=msg.term,
                    scheduler=self.election.scheduler)  # fmt: skip
            msg = msgspec.structs.replace(msg, transfer=False)
        if h.facts.state not in (DaemonState.ACTIVE, DaemonState.LEAVING):
            return  # a leaving member still votes: its own leave may need the new scheduler
        was_scheduler = self.is_scheduler
        if self.role is not None:  # a handover's vote: compare with what it committed
            self.election.issued(self.role.epoch)
        granted = self.election.on_request_vote(msg, now, h.facts.epoch)
        answer = self.votes.grant(granted, msg.sender)
        if was_scheduler and self.election.role != Role.SCHEDULER:
            self._drop()
            h.event("stepped_down", term=h.facts.term)
        h.out.respond(reply, answer)

    def on_vote_reply(self, msg: VoteReply, reply: ReplyPath | None, now: float) -> None:
        """Counts a vote; takes the role on a majority."""
        was_scheduler = self.is_scheduler
        msg = self.votes.take(msg, self.ctx.facts.view)  # a vote whose signature fails is no vote
        if self.role is not None and msg.sender in self.role.last_heard:
            self.role.failures.heard(msg.sender, now)  # a late reply: its sender is alive
        if self.election.on_vote_reply(msg, now, self.ctx.facts.members()):
            self.become_scheduler(now)
        elif was_scheduler and self.election.role != Role.SCHEDULER:
            self._drop()
            self.ctx.event("stepped_down", term=self.ctx.facts.term)

    def on_timeout_now(self, msg: TimeoutNow, reply: ReplyPath | None, now: float) -> None:
        """A leaving scheduler's handover: start an election at once (obeyed only from the
        scheduler this node follows)."""
        if not self.election.honours_handover(msg.sender):
            self.ctx.event("handover_ignored", peer=msg.sender, scheduler=self.election.scheduler)
            return
        # a leaving member takes the handover too: the scheduler that sent it is gone, and its
        # own leave (and anyone else's) needs a scheduler (see become_scheduler)
        state = self.ctx.facts.state
        if state in (DaemonState.ACTIVE, DaemonState.LEAVING) and not self.is_scheduler:
            self.start_election(now, transfer=True)

    def start_election(self, now: float, transfer: bool = False) -> None:
        """Stands as a candidate (wins at once when it alone is a majority)."""
        h = self.ctx
        members = h.facts.members()
        if h.node_id not in members:
            self.election.disarm()
            return
        if self.election.scheduler is not None or self._prev_scheduler is None:
            known = self.election.scheduler or (h.facts.view.scheduler if h.facts.view else None)
            if known is not None and known != h.node_id:
                self._prev_scheduler = (known, self.election.last_scheduler_contact)
        if self.election.term >= MAX_COUNTER:
            self.election.disarm()
            log.error("term %d is at the wire limit: this node stands no more", h.facts.term)
            h.event("counter_limit", counter="term", value=h.facts.term)
            return
        rv = self.election.start(now, h.facts.epoch, transfer)
        self.votes.stand(self.election.term)
        h.event("election_started", term=h.facts.term, transfer=transfer)
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
        h = self.ctx
        if bootstrap:
            self.election.term = 1
            self.votes.stand(1)
        former = self._prev_scheduler
        silent = carried_silence(former, self.election.heard)
        self.election.become_scheduler(now)
        view = None if bootstrap else h.facts.view
        role = SchedulerRole(h, view, now, old_scheduler=silent,
                             on_lost_quorum=lambda: self.lose_quorum(time.monotonic()))  # fmt: skip
        h.facts.role = role
        role.trainers.absorb(h.node_id, self.trainer.report_fields())
        self._prev_scheduler = None
        h.event(
            "elected",
            term=h.facts.term,
            epoch=h.facts.epoch,
            former=former[0] if former is not None else None,
            former_heard_s=_ago(now, silent[1]) if silent is not None else None,
        )
        self.timers.wake("heartbeat", now)  # announce at once
        self.timers.wake("failures", now)
        if h.facts.state == DaemonState.LEAVING:  # its request went to the old scheduler
            h.out.to_scheduler(self.leave_request())

    def check_failures(self, now: float) -> None:
        """The scheduler's failure check, when due (timer ``failures``): members silent for
        ``failure_timeout_s`` fail, a rebuild past its deadline commits; then the timer is set
        to the next deadline (a member does nothing, and looks again in a second)."""
        role, timers = self.role, self.timers
        if role is None:
            timers.set("failures", now + 1.0)
            return
        nxt = min(role.next_failure_deadline(), role.rebuild_deadline)
        if now >= nxt or timers.is_due("failures", now):
            role.check_failures(now)
        role = self.role  # a lost quorum gave the role up
        if role is not None:
            heartbeat = now + self.ctx.cfg.heartbeat_interval_s
            timers.set("failures", max(now + 0.001, min(role.next_failure_deadline(), heartbeat)))

    def lose_quorum(self, now: float) -> None:
        """The scheduler no longer hears a majority: step down and pause.

        The role is dropped at once, so a paused scheduler commits nothing more; it keeps its
        term and may vote for (or become) the next scheduler.
        """
        self._drop()
        self.election.step_down(self.election.term, now)
        self.ctx.event("paused", reason="no majority heard", term=self.ctx.facts.term)

    def on_stale_term(self, term: int, now: float) -> None:
        """A peer refused this node's message for a higher ``term``: step down to it."""
        if self.is_scheduler:
            self.ctx.event("stepped_down", term=term)
        self._drop()
        self.election.step_down(term, now)



def _ago(now: float, then: float) -> float | None:
    """Seconds since ``then`` (``None``: never)."""
    return now - then if math.isfinite(then) else None
