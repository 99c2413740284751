"""The scheduler role (paper IV-B, Fig. 4): what the elected node runs, and with what.

:class:`SchedulerRole` builds the scheduler's collaborators over one cluster monitor and routes
the messages that only the scheduler handles to them:

* :class:`~chaos.daemon.scheduler.ledger.EpochLedger`: commits, acknowledgements, the quorum
  base, the primitives waiting for their epoch;
* :class:`~chaos.daemon.scheduler.failures.FailureDetector`: when each member was last heard;
* :class:`~chaos.daemon.scheduler.rebuild.ViewRebuild`: the view rebuilt after an election;
* :class:`~chaos.daemon.scheduler.scale_out.ScaleOuts`: the joins;
* :class:`~chaos.daemon.scheduler.links.LinkOps` and
  :class:`~chaos.daemon.scheduler.link_checks.LinkChecks`: connect-link, disconnect-link, and
  the bandwidth refinements;
* :class:`~chaos.daemon.scheduler.registry.TrainerRegistry`: the trainers;
* :class:`~chaos.daemon.scheduler.stragglers.StragglerWatch`: the trainers' step progress, and
  who holds the others up;
* :class:`~chaos.daemon.scheduler.offenders.OffenderWatch`: the steps the trainers skipped as
  non-finite, and which device spoils them too often.

It carries out itself what spans several of them: a scale-in, for a leave (``after_allreduce``)
or a failure (``before_next_allreduce``, and the allreduce in flight restarts), and the eviction
of a straggler's or a repeat offender's trainer (like a trainer that exited: the node stays a
member without a trainer, and the others rerun their step without it). Step-boundary rules
(paper IV-B): planned changes apply after the current allreduce; failures apply before the next
one and restart any allreduce in flight.

Quorum: a member silent for ``failure_timeout_s`` is failed. If the members still heard are not
a strict majority of the quorum base (the membership of the newest committed epoch, a leaver
already out of it: :mod:`chaos.daemon.scheduler.quorum`), nothing is removed: the scheduler
steps down and pauses, and commits nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeAlias

import msgspec
from chaos.daemon.context import Context, NodeFacts
from chaos.daemon.scheduler.failures import FailureDetector
from chaos.daemon.scheduler.ledger import EpochLedger
from chaos.daemon.scheduler.link_checks import LinkChecks
from chaos.daemon.scheduler.links import LinkOps
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.offenders import Offender, OffenderWatch
from chaos.daemon.scheduler.rebuild import ViewRebuild
from chaos.daemon.scheduler.registry import TrainerRegistry
from chaos.daemon.scheduler.scale_out import ScaleOuts
from chaos.daemon.scheduler.stragglers import Straggler, StragglerWatch
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    AgentReport,
    ClusterView,
    JoinRequest,
    LeaveRequest,
    LinkReport,
    LinkRequest,
    NonfiniteStep,
    PolicyAck,
    Reason,
    ReplicationWire,
    Resources,
    StepFailed,
    TimeoutNow,
    TrainerGone,
    TrainerProgress,
)
from chaos.protocol.states import NodeState, TrainerState

log = logging.getLogger("chaos.daemon.scheduler")


class SchedulerRole:
    """The scheduler's state and primitives.

    Args:
        ctx: The daemon's context (identity, term, sends, events; timeouts and planner
            settings in its config).
        view: The last view this node installed (``None``: a new cluster of this node alone).
        now: Monotonic time.
        old_scheduler: The scheduler this one replaces, with the last time it was heard.
        on_lost_quorum: Told when the members still heard are no majority (the succession
            steps down and pauses).
    """

    def __init__(
        self,
        ctx: DaemonContext,
        view: ClusterView | None,
        now: float,
        old_scheduler: tuple[str, float] | None = None,
        on_lost_quorum: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = cfg = ctx.cfg
        self._on_lost_quorum = on_lost_quorum
        me = ctx.facts
        if view is None:
            self.monitor = ClusterMonitor()
            self.monitor.add_node(
                me.node_id, me.address, NodeState.ACTIVE, time.time(), me.public_key,
                me.sign_key,
            )
        else:
            self.monitor = ClusterMonitor.from_view(view)
        members = self.monitor.members()
        self.failures = FailureDetector(me.node_id, cfg, members, now)
        if old_scheduler is not None and old_scheduler[0] in self.failures.last_heard:
            self.failures.heard(old_scheduler[0], old_scheduler[1])
        self.ledger = EpochLedger(
            ctx, self.monitor, view.epoch if view is not None else 0, self._carried
        )
        self.trainers = TrainerRegistry(ctx, self.monitor, self.ledger, self.failures)
        waiting = set(members) - {me.node_id} if view is not None else set()
        self.rebuild = ViewRebuild(
            self.monitor, self.ledger, self.trainers, waiting, now + cfg.failure_timeout_s
        )
        self.scale_outs = ScaleOuts(
            ctx, self.monitor, self.ledger, self.failures, self.trainers
        )
        self.links = LinkOps(ctx, self.monitor, self.ledger)
        # bandwidth refinements, and the probes that confirm one that would re-wire the data plane
        self.checks = LinkChecks(ctx, self.monitor, self.ledger, self.links)
        # the trainers' step progress: who holds the others up (a report counts for a few
        # heartbeat intervals, the time it takes the next one to come)
        self.stragglers = StragglerWatch(
            cfg.straggler_grace_s, 3 * cfg.heartbeat_interval_s, cfg.behind_grace_s
        )
        # the steps the trainers skipped as non-finite: who spoils them too often
        self.offenders = OffenderWatch(cfg.offender_limit, cfg.offender_window_steps)

    def _carried(self) -> ReplicationWire | None:
        return self.trainers.carried()

    # -- what the daemon and the tests read ------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch committed last."""
        return self.ledger.epoch

    @property
    def last_heard(self) -> dict[str, float]:
        """When each member was last heard (monotonic time)."""
        return self.failures.last_heard

    @property
    def stable_members(self) -> frozenset[str]:
        """The quorum base."""
        return self.ledger.stable_members

    @property
    def rebuild_deadline(self) -> float:
        """When a rebuild after an election commits without the missing reports."""
        return self.rebuild.deadline

    # -- messages --------------------------------------------------------------------------

    def on_heartbeat(self, sender: str, resources: Resources | None, now: float) -> None:
        """Records a member's heartbeat."""
        self.failures.heard(sender, now)
        if resources is not None:
            self.monitor.set_resources(sender, resources)

    def on_ack(self, msg: PolicyAck, now: float) -> None:
        """Counts a member's acknowledgement of an epoch."""
        self.failures.heard(msg.sender, now)
        self.ledger.on_ack(msg, now)

    def on_agent_report(self, msg: AgentReport, now: float) -> None:
        """Rebuilds the view from an agent's report after an election."""
        self.failures.heard(msg.sender, now)
        self.rebuild.on_report(msg, now)

    def on_join(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        """Starts a scale-out (or refuses it)."""
        self.scale_outs.on_join(msg, reply, now)

    def on_link_request(self, msg: LinkRequest, reply: ReplyPath | None, now: float) -> None:
        """Connect-link or disconnect-link."""
        self.links.on_request(msg, reply, now)

    def on_link_report(self, msg: LinkReport, now: float) -> None:
        """A neighbour's measurement: completes a scale-out, a connect-link, or refines a link."""
        if self.scale_outs.take(msg, now) or self.links.take(msg, now):
            return
        if msg.op_id.startswith("pre-"):
            return  # the measurement of a connect-link that was refused or timed out
        if self.checks.take(msg, now):
            return  # a confirming probe
        if msg.up and self.monitor.link(msg.sender, msg.peer) is not None:
            self.checks.refine(msg, now)  # a bandwidth refinement

    # -- scale-in --------------------------------------------------------------------------

    def on_leave(self, msg: LeaveRequest, reply: ReplyPath | None, now: float) -> None:
        """Scale-in for a graceful leave; a leaving scheduler hands over afterwards."""
        node = msg.node_id
        if node != msg.sender or not self.monitor.has(node):
            self.ledger.refuse(reply, msg.op_id, Reason.BAD_REQUEST, f"{node} cannot leave")
            return
        self.monitor.set_state(node, NodeState.LEAVING)
        self._remove(node, now)  # a leaver acknowledges nothing more
        op = self.ledger.commit("scale_in_leave", now, reply=reply, req_op_id=msg.op_id)
        if node == self.ctx.node_id:
            op.after = TimeoutNow(sender=node, epoch=self.epoch, term=self.ctx.facts.term)
        if not op.waiting:
            self.ledger.complete(op, now, ok=True)

    def next_failure_deadline(self) -> float:
        """When the next member would time out (for the loop's timer)."""
        return self.failures.next_deadline()

    def check_failures(self, now: float) -> None:
        """Scales in members silent for ``failure_timeout_s``, if a majority is still heard."""
        members = self.monitor.members()
        ledger = self.ledger
        base = ledger.stable_members
        verdict = self.failures.check(members, base, ledger.last_update is not None, now)
        if not verdict.overdue:
            self.rebuild.maybe_finish(now)
            return
        if verdict.quorum_lost:
            self.ctx.event(
                "quorum_lost", members=members, base=sorted(base), silent=verdict.overdue
            )
            if self._on_lost_quorum is not None:
                self._on_lost_quorum()
            return
        if ledger.quorum.settling and ledger.last_update is not None:
            return  # one unacknowledged membership change at a time (Raft's single change)
        for m in verdict.failed:
            self.monitor.set_state(m, NodeState.FAILED)
            self.rebuild.forget(m)
            self.ctx.event("node_failed", peer=m, silent_s=verdict.silent_s[m])
            self._remove(m, now)
        if ledger.last_update is None:  # still rebuilding after an election: one commit for all
            self.rebuild.maybe_finish(now)
            return
        ledger.commit("scale_in_failure", now, apply_at="before_next_allreduce", restart=True)

    def _remove(self, node: str, now: float) -> None:
        """Takes a member that left or failed out of the monitor and of every wait."""
        self.monitor.remove_node(node)
        self.failures.forget(node)
        self.trainers.forget(node)
        self.stragglers.forget(node)
        self.offenders.forget(node)
        self.ledger.wait_for_none_from(node, now)
        self.scale_outs.forget(node)

    # -- timers ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Times out primitives, joins and link operations; commits held allreduce restarts."""
        self.ledger.tick(now)
        self.links.tick(now)
        self.scale_outs.tick(now)
        self.trainers.tick(now)
        self.evict_stragglers(now)

    # -- trainers' step progress and stragglers --------------------------------------------

    def on_trainer_progress(self, msg: TrainerProgress, now: float) -> None:
        """A member's forwarded step progress (one-way, never answered): its phase, a pull's
        progress, or its step (recorded for the straggler watch and tau_sync)."""
        n = msg.sender
        self.monitor.observe_phase(n, msg.phase)
        if msg.pulling is not None:
            self.monitor.observe_pull_progress(n, msg.pulling, now)  # says nothing of steps
            return
        if self.monitor.trainer(n) == TrainerState.TRAINING:
            self.failures.heard(n, now)
            self.stragglers.report(n, msg.step, msg.in_step, msg.elapsed_s, msg.silent_s, now)
            self.trainers.on_progress(msg, now)  # its step boundaries date tau_sync

    def on_step_failed(self, msg: StepFailed, reply: ReplyPath | None, now: float) -> None:
        """A member's trainer's failed step: blamed on the member that stopped, when one is
        known (the neighbour the trainer's round named only stopped forwarding), then the
        registry commits or holds the restart and answers."""
        n = msg.sender
        if self.monitor.trainer(n) != TrainerState.NONE:
            neighbour = msg.detail
            training = self.monitor.trainer_members((TrainerState.TRAINING,))
            peer = self.stragglers.blame(n, neighbour, msg.elapsed_s, training, now)
            self.ctx.event(
                "allreduce_failed", peer=peer, reporter=n, neighbour=neighbour, epoch=msg.epoch,
                waited_s=msg.elapsed_s,
            )  # fmt: skip
            if peer != neighbour:
                msg = msgspec.structs.replace(msg, detail=peer)
            elif self.failures.fresh(neighbour, now):
                # no straggler explains it and the neighbour's daemon is heard: the link
                # between the two may be what failed; check it at once (disconnect-link if so)
                self.links.verify(n, neighbour, now)
        self.trainers.on_event(msg, reply, now)

    def on_trainer_gone(self, msg: TrainerGone, reply: ReplyPath | None, now: float) -> None:
        """A member's trainer process exited: no straggler or offender record is kept for it;
        the registry takes the trainer out and answers."""
        self.stragglers.forget(msg.sender)
        self.offenders.forget(msg.sender)
        self.trainers.on_event(msg, reply, now)

    def evict_stragglers(self, now: float) -> None:
        """Takes the trainers found holding the others up (silent, or stuck a step behind) out
        of the sync policy: each node stays a member without a trainer, and the others rerun
        their step without it (one commit, before the next allreduce, restarting the one in
        flight). An evicted trainer that resumes, or that learns it was left out, joins again,
        pulling the state."""
        if self.ledger.last_update is None:
            return  # still rebuilding after an election
        training = self.monitor.trainer_members((TrainerState.TRAINING,))
        found = [s for s in self.stragglers.find(training, now) if self.failures.fresh(s.node, now)]
        silent = {s.node for s in found}
        found += [s for s in self.stragglers.behind(training, now) if s.node not in silent]
        for s in found:
            self._evict(s)
        if found:
            self.ledger.commit(
                "straggler_evicted", now, apply_at="before_next_allreduce", restart=True
            )

    def _take_trainer_out(self, node: str) -> None:
        """Leaves ``node`` a member without a trainer (an eviction from the sync policy)."""
        self.monitor.set_trainer(node, TrainerState.NONE, None, None)
        self.trainers.forget(node)
        self.stragglers.forget(node)

    def _evict(self, s: Straggler) -> None:
        self._take_trainer_out(s.node)
        self.ctx.event(
            "straggler_evicted", peer=s.node, step=s.step, silent_s=round(s.silent_s, 3),
            at_step=s.at_step, waiting=list(s.waiting), waited_s=round(s.waited_s, 3),
            behind=s.behind,
        )  # fmt: skip

    # -- repeat offenders: devices whose gradients keep spoiling the steps ------------------

    def on_nonfinite(self, msg: NonfiniteStep, now: float) -> None:
        """A training member's report of a step it skipped as non-finite, naming the devices
        whose gradients were bad: counted (:mod:`chaos.daemon.scheduler.offenders`); a device
        due is evicted from the sync policy (one commit, before the next allreduce, restarting
        the one in flight), and its trainer joins again, pulling the state."""
        training = self.monitor.trainer_members((TrainerState.TRAINING,))
        self.offenders.report(msg.sender, msg.step, msg.devices, training)
        if self.ledger.last_update is None:
            return  # still rebuilding after an election: the next report evicts
        found = self.offenders.due(training)
        for o in found:
            self._evict_offender(o)
        if found:
            self.ledger.commit(
                "offender_evicted", now, apply_at="before_next_allreduce", restart=True
            )

    def _evict_offender(self, o: Offender) -> None:
        self._take_trainer_out(o.node)
        self.offenders.forget(o.node)
        self.ctx.event(
            "offender_evicted", peer=o.node, offences=o.count, steps=list(o.steps),
            limit=o.limit, window_steps=o.window,
        )  # fmt: skip
        log.warning(
            "%s: evicted from the sync policy: its gradients made %d steps non-finite within "
            "%d steps (steps %s; offender_limit %d); it joins again, pulling the state",
            o.node, o.count, o.window, ", ".join(map(str, o.steps)), o.limit,
        )  # fmt: skip


DaemonContext: TypeAlias = Context[SchedulerRole]
"""The context as the member side's flows hold it: its facts' role, while this node holds it,
is a :class:`SchedulerRole`."""

DaemonFacts: TypeAlias = NodeFacts[SchedulerRole]
"""The facts as the member side's flows read them (see :data:`DaemonContext`)."""
