"""The installed cluster view: each :class:`~chaos.protocol.ClusterUpdate` taken and acknowledged.

:class:`ViewInstaller` installs the view and the update (with its policies) in the daemon's
facts. An update that lists this node is installed: the DEALERs follow the membership, the agent
probes the new neighbours, and a :class:`~chaos.protocol.PolicyAck` goes back at once (the event
log and the metrics come after, off the scheduler's critical path). An update without this node
goes to :class:`~chaos.daemon.membership.Membership` (a leave is done, or this node was dropped).
"""

from __future__ import annotations

from chaos.daemon.agent import Agent
from chaos.daemon.dispatch import Handler, scheduler_side
from chaos.daemon.membership import Membership
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.states import DaemonState
from chaos.daemon.succession import Succession
from chaos.daemon.transport import ReplyPath, Transport

from chaos.protocol import ClusterUpdate, PolicyAck


class ViewInstaller:
    """This member's installed view and update.

    Args:
        ctx: The daemon's context (the installed view and update are kept in its facts).
        succession: Follows a new scheduler an update reveals.
        membership: This node's join and leave (an update admits it, or drops it).
        transport: The DEALERs, opened and closed to follow the membership.
        agent: Probes this node's links in the new view.
    """

    def __init__(
        self,
        ctx: DaemonContext,
        succession: Succession,
        membership: Membership,
        transport: Transport,
        agent: Agent,
    ) -> None:
        self.ctx = ctx
        self.succession = succession
        self.membership = membership
        self.transport = transport
        self.agent = agent

    def handlers(self) -> dict[type, Handler]:
        """The view flow: an update installed and acknowledged here, and on the scheduler's side
        the members' acknowledgements."""
        return {
            ClusterUpdate: self.on_cluster_update,
            PolicyAck: scheduler_side(self.ctx.facts, lambda n, m, r, t: n.on_ack(m, t)),
        }

    def on_cluster_update(self, msg: ClusterUpdate, reply: ReplyPath | None, now: float) -> None:
        """Installs and acknowledges an update (or hands one without this node on)."""
        h = self.ctx
        if h.node_id not in {n.id for n in msg.view.nodes}:
            self.membership.on_dropped_from_view(msg, reply, now)
            return
        if h.facts.state == DaemonState.JOINING:
            self.membership.on_admitted(msg, now)
        elif msg.sender != h.node_id and (
            msg.term > h.facts.term or h.facts.election.scheduler != msg.sender
        ):
            self.succession.follow(msg.term, msg.sender, now)
        self._install(msg, now)
        # acknowledge as soon as the view and policy are in place; the event log and metrics
        # come after, off the scheduler's critical path
        h.out.respond(reply, PolicyAck(sender=h.node_id, epoch=msg.epoch, term=h.facts.term))
        self._record(msg)

    def _install(self, msg: ClusterUpdate, now: float) -> None:
        self.ctx.facts.view = msg.view
        self.ctx.facts.update = msg
        keep = {msg.sender} | {m.cmd.peer for m in self.agent.measurements.values()}
        for n in msg.view.nodes:
            if n.id != self.ctx.node_id:
                self.transport.ensure_peer(n.id, n.address)
                keep.add(n.id)
        for peer in list(self.transport.dealers):
            if peer not in keep:
                self.transport.drop_peer(peer)
        self.agent.set_view(msg.view, now)

    def _record(self, msg: ClusterUpdate) -> None:
        h = self.ctx
        h.event(
            "view_installed",
            epoch=msg.epoch,
            term=msg.term,
            cause=msg.cause,
            scheduler=msg.view.scheduler,
            members=sorted(n.id for n in msg.view.nodes),
            apply_at=msg.apply_at,
            restart_allreduce=msg.restart_allreduce,
            sync_kind=msg.sync.kind,
            replication_skipped=msg.replication.skipped if msg.replication else None,
        )
        f = h.facts
        h.metrics.state(f.epoch, f.term, len(msg.view.nodes), f.is_scheduler, f.paused)
