"""The peer negotiator (paper IV-B, Fig. 4), run by the elected scheduler.

Primitives, each ending in a *commit*: the epoch is bumped, the plan generator builds the new sync
policy (and for scale-out the replication policy), and a :class:`~chaos.protocol.ClusterUpdate`
goes to every member. A primitive completes when every member acknowledged that epoch; its
requester then gets an :class:`~chaos.protocol.OpResult` with the control-path time.

* **scale-out**: the joiner's neighbours connect to it and measure the links (latency and
  bandwidth); then the replication and sync policies are issued (``after_allreduce``).
* **scale-in** for a leave (``after_allreduce``) or a failure (``before_next_allreduce``, and the
  allreduce in flight restarts).
* **connect-link**: one end connects and pings; the policy is issued; the bandwidth is measured
  afterwards (overlapping training); a ``link_measured`` update follows only when the measurement
  changes the sync policy's structure (otherwise the scheduler's monitor records it, and the
  members see it with the next epoch).
* **disconnect-link**: requested (``after_allreduce``; refused if it would disconnect the
  overlay) or a failed probe (``before_next_allreduce`` with restart; the link stays, marked down).

Step-boundary rules (paper IV-B): planned changes apply after the current allreduce; failures
apply before the next one and restart any allreduce in flight.

Failure detection and quorum: a member silent for ``failure_timeout_s`` is failed. If the members
still heard are not a strict majority, nothing is removed: the scheduler steps down and pauses.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from chaos.daemon.config import DaemonConfig
from chaos.daemon.scheduler.link_checks import LinkChecks
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.planner import (
    data_addresses,
    replication_policy,
    same_data_plane,
    sync_policy,
    to_wire,
)
from chaos.daemon.scheduler.trainers import TrainerRegistry
from chaos.protocol.states import NodeState
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    AgentReport,
    ApplyAt,
    ClusterUpdate,
    ClusterView,
    ConnectCommand,
    JoinRequest,
    LeaveRequest,
    LinkReport,
    LinkRequest,
    Message,
    OpResult,
    PolicyAck,
    Reason,
    Refusal,
    ReplicationWire,
    SyncPolicyWire,
    TimeoutNow,
)

log = logging.getLogger("chaos.daemon.scheduler.negotiator")

class SchedulerHost(Protocol):
    """What the negotiator needs from its daemon."""

    node_id: str
    address: str

    @property
    def term(self) -> int: ...  # noqa: D102

    def send(self, peer: str, msg: Message) -> bool: ...  # noqa: D102

    def respond(self, reply: ReplyPath | None, msg: Message) -> None: ...  # noqa: D102

    def send_to_address(self, peer: str, address: str, msg: Message) -> None: ...  # noqa: D102

    def connect_peer(self, peer: str, address: str) -> None: ...  # noqa: D102

    def broadcast(self, peers: dict[str, str], msg: Message) -> None: ...  # noqa: D102

    def event(self, name: str, **fields: object) -> None: ...  # noqa: D102

    def observe_primitive(self, name: str, seconds: float) -> None: ...  # noqa: D102

    def lost_quorum(self) -> None: ...  # noqa: D102


@dataclass
class PendingOp:
    """A committed primitive waiting for every member's acknowledgement."""

    name: str
    epoch: int
    started: float
    waiting: set[str]
    op_id: str = ""
    reply: ReplyPath | None = None
    req_op_id: str = ""
    deadline: float = 0.0
    after: TimeoutNow | None = None
    then: Callable[[], object] | None = None
    """Run once the primitive completes (or fails): follow-up work, such as ordering a link's
    bandwidth probe, kept off the primitive's critical path."""


@dataclass
class ScaleOut:
    """A join in progress: waiting for the neighbours' link reports."""

    req: JoinRequest
    op_id: str
    started: float
    deadline: float
    waiting: set[str]
    reports: dict[str, LinkReport] = field(default_factory=dict)


@dataclass
class LinkOp:
    """A connect-link waiting for its link report."""

    req: LinkRequest
    reply: ReplyPath | None
    started: float
    deadline: float


class Negotiator:
    """The scheduler's state and primitives.

    Args:
        host: The daemon.
        cfg: Timeouts and planner settings.
        view: The last view this node installed (``None``: a new cluster of this node alone).
        now: Monotonic time.
        old_scheduler: The scheduler this one replaces, with the last time it was heard.
    """

    def __init__(
        self,
        host: SchedulerHost,
        cfg: DaemonConfig,
        view: ClusterView | None,
        now: float,
        old_scheduler: tuple[str, float] | None = None,
    ) -> None:
        self.host = host
        self.cfg = cfg
        if view is None:
            self.monitor = ClusterMonitor()
            self.monitor.add_node(host.node_id, host.address, NodeState.ACTIVE, time.time())
            self.epoch = 0
        else:
            self.monitor = ClusterMonitor.from_view(view)
            self.epoch = view.epoch
        self.last_heard = {m: now for m in self.monitor.members()}
        # Quorum base: the last membership acknowledged by a majority of itself and of the base
        # before it. Failures are judged against it, so a minority cannot shrink the membership
        # one silent node at a time (the role of Raft's joint consensus).
        self.stable_members: frozenset[str] = frozenset(self.monitor.members())
        self.acked: dict[str, int] = {}
        self.pending_views: dict[int, frozenset[str]] = {}
        self.rebuilding: set[str] = set()
        if view is not None:
            self.rebuilding = set(self.monitor.members()) - {host.node_id}
        if old_scheduler is not None and old_scheduler[0] in self.last_heard:
            self.last_heard[old_scheduler[0]] = old_scheduler[1]
        self.rebuild_deadline = now + cfg.failure_timeout_s
        self.ops: dict[str, PendingOp] = {}
        self.scaleouts: dict[str, ScaleOut] = {}
        self.linkops: dict[str, LinkOp] = {}
        # bandwidth refinements, and the probes that confirm one that would re-wire the data plane
        self.checks = LinkChecks(self)
        self.last_sync: SyncPolicyWire | None = None
        self.last_update: ClusterUpdate | None = None
        self.trainers = TrainerRegistry(self)

    # -- commit ----------------------------------------------------------------------------

    def commit(
        self,
        cause: str,
        now: float,
        *,
        apply_at: ApplyAt = "after_allreduce",
        restart: bool = False,
        reply: ReplyPath | None = None,
        req_op_id: str = "",
        replication: ReplicationWire | None = None,
        started: float | None = None,
    ) -> PendingOp:
        """Bumps the epoch and issues the new view and policies to every member.

        Without ``replication``, the update carries the plan of a joiner still syncing.
        """
        self.epoch += 1
        view = self.monitor.to_view(self.epoch, self.host.term, self.host.node_id)
        sync = self.current_sync()
        if replication is None:
            replication = self.trainers.carried()
        sync = self._stamp_topology(sync, restart)
        op_id = uuid.uuid4().hex[:12]
        upd = ClusterUpdate(
            sender=self.host.node_id,
            epoch=self.epoch,
            term=self.host.term,
            view=view,
            sync=sync,
            replication=replication,
            apply_at=apply_at,
            restart_allreduce=restart,
            cause=cause,
            op_id=op_id,
        )
        self.last_update = upd
        members = set(self.monitor.members())
        op = self._track(
            cause, members, op_id, reply, req_op_id, started if started is not None else now, now
        )
        self._announce(upd, members)
        return op

    def _stamp_topology(self, sync: SyncPolicyWire, restart: bool) -> SyncPolicyWire:
        """Sets the policy's ``topology_epoch`` and records it as the policy in force.

        The topology epoch is kept from the policy in force while the data plane stays wired
        the same (and no restart is ordered); otherwise it is the new epoch.

        Args:
            sync: The policy being committed.
            restart: Whether the commit restarts the allreduce in flight.

        Returns:
            ``sync`` with its ``topology_epoch`` set (also stored in ``last_sync``).
        """
        prev = self.last_sync
        same = not restart and prev is not None and same_data_plane(prev, sync)
        topo_epoch = prev.topology_epoch if same and prev and prev.topology_epoch else self.epoch
        sync = msgspec.structs.replace(sync, topology_epoch=topo_epoch)
        self.last_sync = sync
        return sync

    def _track(
        self,
        cause: str,
        members: set[str],
        op_id: str,
        reply: ReplyPath | None,
        req_op_id: str,
        started: float,
        now: float,
    ) -> PendingOp:
        """Records the committed epoch's view and the primitive waiting for its acks.

        Args:
            cause: The primitive's name.
            members: The members that must acknowledge the epoch.
            op_id: The update's op id.
            reply: Where the requester waits for the result.
            req_op_id: The requester's op id.
            started: When the primitive started.
            now: Monotonic time (the op's deadline counts from it).

        Returns:
            The pending primitive, registered in ``ops``.
        """
        self.pending_views[self.epoch] = frozenset(members)
        op = PendingOp(
            cause,
            self.epoch,
            started,
            set(members),
            op_id,
            reply,
            req_op_id,
            now + self.cfg.op_timeout_s,
        )
        self.ops[op_id] = op
        return op

    def _announce(self, upd: ClusterUpdate, members: set[str]) -> None:
        """Sends a committed update to every member and logs the ``committed`` event.

        Args:
            upd: The update.
            members: Its recipients.
        """
        self.host.broadcast(
            {m: self.monitor.address(m) for m in sorted(members)}, upd
        )  # encoded once, sent to every member (to itself through the local queue)
        self.host.event(
            "committed",
            cause=upd.cause,
            epoch=self.epoch,
            term=self.host.term,
            members=sorted(members),
            sync_kind=upd.sync.kind,
            topology_epoch=upd.sync.topology_epoch,
            apply_at=upd.apply_at,
            restart_allreduce=upd.restart_allreduce,
            op_id=upd.op_id,
        )

    def on_ack(self, msg: PolicyAck, now: float) -> None:
        """Counts a member's acknowledgement of an epoch."""
        self.last_heard[msg.sender] = now
        self.acked[msg.sender] = max(self.acked.get(msg.sender, 0), msg.epoch)
        self._advance_stable()
        for op in list(self.ops.values()):
            if op.epoch <= msg.epoch:
                op.waiting.discard(msg.sender)
                if not op.waiting:
                    self._complete(op, now, ok=True)

    def _advance_stable(self) -> None:
        for e in sorted(self.pending_views):
            new = self.pending_views[e]
            if not (
                _majority_acked(self.stable_members, self.acked, e)
                and _majority_acked(new, self.acked, e)
            ):
                return
            self.stable_members = new
            del self.pending_views[e]

    def _complete(self, op: PendingOp, now: float, ok: bool, reason: Reason | None = None) -> None:
        if self.ops.pop(op.op_id, None) is None:
            return
        elapsed = now - op.started
        if op.reply is not None or op.req_op_id:  # the answer first, the bookkeeping after
            self.host.respond(
                op.reply,
                OpResult(
                    sender=self.host.node_id,
                    epoch=self.epoch,
                    op_id=op.req_op_id,
                    ok=ok,
                    reason=reason,
                    elapsed_s=elapsed,
                ),
            )
        self.host.event(
            "primitive_done",
            primitive=op.name,
            epoch=op.epoch,
            ok=ok,
            elapsed_s=elapsed,
            reason=reason,
        )
        if ok:
            self.host.observe_primitive(op.name, elapsed)
        if op.then is not None:
            op.then()
        if op.after is not None:  # the scheduler itself has left
            # answer the other leavers whose views it committed: it will not be there to see
            # those views acknowledged, and their leaves are done once committed
            for other in [o for o in self.ops.values() if o.name == "scale_in_leave"]:
                self._complete(other, now, ok=True)
            target = min(self.monitor.members(), default=None)
            if target is not None:  # stamped now: a later commit made its epoch stale
                self.host.send(target, msgspec.structs.replace(op.after, epoch=self.epoch))

    def _fail(self, reply: ReplyPath | None, req_op_id: str, reason: Reason, detail: str) -> None:
        self.host.event("primitive_refused", reason=reason, detail=detail)
        self.host.respond(
            reply,
            OpResult(
                sender=self.host.node_id,
                epoch=self.epoch,
                op_id=req_op_id,
                ok=False,
                reason=reason,
                detail=detail,
            ),
        )

    # -- heartbeats, failures, re-election rebuild -----------------------------------------

    def on_heartbeat(self, sender: str, resources: object, now: float) -> None:
        """Records a member's heartbeat."""
        self.last_heard[sender] = now
        if resources is not None:
            self.monitor.set_resources(sender, resources)

    def next_failure_deadline(self) -> float:
        """When the next member would time out (for the loop's timer)."""
        others = [t for m, t in self.last_heard.items() if m != self.host.node_id]
        return (min(others) if others else float("inf")) + self.cfg.failure_timeout_s

    def check_failures(self, now: float) -> None:
        """Scales in members silent for ``failure_timeout_s``, if a majority is still heard."""
        members = self.monitor.members()
        self.last_heard[self.host.node_id] = now
        silent = {m: now - self.last_heard.get(m, now) for m in members}
        failed = [m for m, s in silent.items() if s > self.cfg.failure_timeout_s]
        if not failed:
            self._maybe_finish_rebuild(now)
            return
        base = self.stable_members
        heard = [m for m in base if m not in failed and (m in silent or m == self.host.node_id)]
        if 2 * len(heard) <= len(base):
            self.host.event("quorum_lost", members=members, base=sorted(base), silent=failed)
            self.host.lost_quorum()
            return
        if self.pending_views and self.last_update is not None:
            return  # one unacknowledged membership change at a time (Raft's single change)
        if self.last_update is not None:
            # Raft's single-server change: remove one member per commit (the longest silent);
            # the next goes once a majority of the old and the new membership acknowledged it.
            # Removing several at once lets a minority's new membership be its own majority: a
            # side of a partition that still heard one member of the other side for a moment
            # would commit a view that its own election could win.
            failed = [max(failed, key=lambda m: (silent[m], m))]
        for m in failed:
            self.monitor.set_state(m, NodeState.FAILED)
            self.monitor.remove_node(m)
            self.last_heard.pop(m, None)
            self.rebuilding.discard(m)
            self.trainers.forget(m)
            self.host.event("node_failed", peer=m, silent_s=silent[m])
            for op in list(self.ops.values()):
                op.waiting.discard(m)
                if not op.waiting:
                    self._complete(op, now, ok=True)
            for so in self.scaleouts.values():
                so.waiting.discard(m)
        if self.last_update is None:  # still rebuilding after an election: one commit for all
            self._maybe_finish_rebuild(now)
            return
        self.commit("scale_in_failure", now, apply_at="before_next_allreduce", restart=True)

    def on_agent_report(self, msg: AgentReport, now: float) -> None:
        """Rebuilds the view from an agent's report after an election."""
        self.last_heard[msg.sender] = now
        self.epoch = max(self.epoch, msg.epoch)
        late = self.last_update is not None  # the rebuild was committed without this report
        changed = False
        if self.monitor.has(msg.sender):
            self.monitor.set_resources(msg.sender, msg.resources)
            for link in msg.links:
                if self.monitor.has(link.a) and self.monitor.has(link.b):
                    self.monitor.set_link(
                        link.a,
                        link.b,
                        up=link.up,
                        latency_s=link.latency_s,
                        bandwidth_bps=link.bandwidth_bps,
                    )
            changed = self.trainers.absorb(
                msg.sender,
                {
                    "trainer": msg.trainer,
                    "data_address": msg.data_address,
                    "shard_address": msg.shard_address,
                    "tensor_sizes": msg.tensor_sizes,
                },
            )
        self.rebuilding.discard(msg.sender)
        self._maybe_finish_rebuild(now)
        if late and changed:  # e.g. a trainer that became ready: its policy must say so
            self.commit("trainer_report", now)

    def _maybe_finish_rebuild(self, now: float) -> None:
        if self.last_update is not None:
            return
        if self.rebuilding and now < self.rebuild_deadline:
            return
        self.rebuilding.clear()
        self.trainers.replan_syncing()
        self.commit("reelection" if self.epoch > 0 else "bootstrap", now)

    # -- scale-out -------------------------------------------------------------------------

    def on_join(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        """Starts a scale-out (or refuses it)."""
        j = msg.node_id
        if j in self.scaleouts:
            return  # a retry of a join in progress
        if self.monitor.has(j):
            fresh = now - self.last_heard.get(j, float("-inf")) < self.cfg.failure_timeout_s
            if self.monitor.address(j) != msg.address and fresh:
                self._refuse_join(msg, Reason.DUPLICATE_ID, f"{j} is a member at another address")
                return
            if fresh and self.last_update is not None:
                self.host.send(j, self.last_update)  # the joiner missed its admission
                return
            self.monitor.remove_node(j)  # a restarted incarnation: scale it in and out again
            self.trainers.forget(j)
        unknown = [n for n in msg.neighbors if not self.monitor.has(n)]
        if unknown:
            self._refuse_join(msg, Reason.UNKNOWN_PEER, f"unknown neighbor(s) {unknown}")
            return
        nbrs = list(msg.neighbors) or [msg.forwarded_by or self.host.node_id]
        self.monitor.add_node(j, msg.address, NodeState.JOINING, time.time())
        so = ScaleOut(
            msg, uuid.uuid4().hex[:12], now, now + self.cfg.probe_timeout_s + 1.0, set(nbrs)
        )
        self.scaleouts[j] = so
        self.host.event("scale_out_started", peer=j, neighbors=nbrs, op_id=so.op_id)
        for n in nbrs:
            self.host.send(
                n,
                ConnectCommand(
                    sender=self.host.node_id,
                    epoch=self.epoch,
                    term=self.host.term,
                    peer=j,
                    address=msg.address,
                    measure_bandwidth=True,
                    op_id=so.op_id,
                ),
            )

    def _refuse_join(self, msg: JoinRequest, reason: Reason, detail: str) -> None:
        self.host.event("join_refused", peer=msg.node_id, reason=reason, detail=detail)
        self.host.send_to_address(
            msg.node_id,
            msg.address,
            Refusal(
                sender=self.host.node_id,
                epoch=self.epoch,
                reason=reason,
                detail=detail,
                ref_type="join_request",
                term=self.host.term,
            ),
        )

    def _finish_scaleout(self, j: str, now: float) -> None:
        so = self.scaleouts.pop(j)
        up = {n: r for n, r in so.reports.items() if r.up and self.monitor.has(n)}
        if not up or not self.monitor.has(j):
            self.monitor.remove_node(j)
            self._refuse_join(so.req, Reason.UNREACHABLE, "no link to the joiner came up")
            return
        for n, r in up.items():
            self.monitor.set_link(
                n, j, up=True, latency_s=r.latency_s, bandwidth_bps=r.bandwidth_bps
            )
        self.monitor.set_state(j, NodeState.ACTIVE)
        self.last_heard[j] = now
        links = {n: (r.latency_s, r.bandwidth_bps) for n, r in up.items()}
        repl = replication_policy(j, links, so.req.state_bytes, so.req.tensor_sizes, self.cfg)
        self.host.event(
            "replication_planned",
            peer=j,
            skipped=repl.skipped,
            shard_size=repl.shard_size,
            makespan_s=repl.makespan_s,
        )
        if repl.skipped:  # keep carrying the plan of a trainer still syncing, if any
            repl = self.trainers.carried() or repl
        self.commit("scale_out", now, replication=repl, started=so.started)

    # -- scale-in (leave) ------------------------------------------------------------------

    def on_leave(self, msg: LeaveRequest, reply: ReplyPath | None, now: float) -> None:
        """Scale-in for a graceful leave; a leaving scheduler hands over afterwards."""
        node = msg.node_id
        if node != msg.sender or not self.monitor.has(node):
            self._fail(reply, msg.op_id, Reason.BAD_REQUEST, f"{node} cannot leave")
            return
        self.monitor.set_state(node, NodeState.LEAVING)
        self.monitor.remove_node(node)
        self.last_heard.pop(node, None)
        self.trainers.forget(node)
        for pending in list(self.ops.values()):  # a leaver acknowledges nothing more
            pending.waiting.discard(node)
            if not pending.waiting:
                self._complete(pending, now, ok=True)
        for so in self.scaleouts.values():
            so.waiting.discard(node)
        op = self.commit("scale_in_leave", now, reply=reply, req_op_id=msg.op_id)
        if node == self.host.node_id:
            op.after = TimeoutNow(sender=node, epoch=self.epoch, term=self.host.term)
        if not op.waiting:
            self._complete(op, now, ok=True)

    # -- links -----------------------------------------------------------------------------

    def on_link_request(self, msg: LinkRequest, reply: ReplyPath | None, now: float) -> None:
        """Connect-link or disconnect-link."""
        a, b = msg.a, msg.b
        if a == b or not self.monitor.has(a) or not self.monitor.has(b):
            self._fail(reply, msg.op_id, Reason.UNKNOWN_PEER, f"link {a}-{b}: unknown node")
            return
        link = self.monitor.link(a, b)
        if msg.op == "connect":
            self._connect(msg, link, reply, now)
        else:
            self._disconnect(msg, link, reply, now)

    def _connect(
        self, msg: LinkRequest, link: dict[str, object] | None, reply: ReplyPath | None, now: float
    ) -> None:
        if link is not None and link["up"]:
            self._fail(reply, msg.op_id, Reason.BAD_REQUEST, "link already up")
            return
        if msg.reason == "probe_recovered" and link is not None:
            self.monitor.set_link(msg.a, msg.b, up=True)
            self.commit("connect_link", now, reply=reply, req_op_id=msg.op_id)
            return
        if msg.premeasured and msg.sender == msg.a:  # a measures it and reports by itself
            self.linkops["pre-" + msg.op_id] = LinkOp(
                msg, reply, now, now + self.cfg.probe_timeout_s
            )
            return
        op_id = uuid.uuid4().hex[:12]
        self.linkops[op_id] = LinkOp(msg, reply, now, now + self.cfg.probe_timeout_s)
        self.host.send(
            msg.a,
            ConnectCommand(
                sender=self.host.node_id,
                epoch=self.epoch,
                term=self.host.term,
                peer=msg.b,
                address=self.monitor.address(msg.b),
                measure_bandwidth=False,
                op_id=op_id,
            ),
        )

    def _disconnect(
        self, msg: LinkRequest, link: dict[str, object] | None, reply: ReplyPath | None, now: float
    ) -> None:
        if link is None or (msg.reason == "probe_failed" and not link["up"]):
            self._fail(reply, msg.op_id, Reason.BAD_REQUEST, "no such link up")
            return
        if msg.reason == "probe_failed":
            self.monitor.set_link(msg.a, msg.b, up=False)
            self.host.event("link_down", a=msg.a, b=msg.b)
            self.commit(
                "disconnect_link",
                now,
                apply_at="before_next_allreduce",
                restart=True,
                reply=reply,
                req_op_id=msg.op_id,
            )
            return
        if link["up"] and not self.monitor.connected_without(msg.a, msg.b):
            self._fail(reply, msg.op_id, Reason.WOULD_DISCONNECT, "the overlay would split")
            return
        self.monitor.remove_link(msg.a, msg.b)
        self.commit("disconnect_link", now, reply=reply, req_op_id=msg.op_id)

    def on_link_report(self, msg: LinkReport, now: float) -> None:
        """A neighbour's measurement: completes a scale-out, a connect-link, or refines a link."""
        j = msg.peer
        so = self.scaleouts.get(j)
        if so is not None and msg.op_id == so.op_id:
            so.reports[msg.sender] = msg
            so.waiting.discard(msg.sender)
            if not so.waiting:
                self._finish_scaleout(j, now)
            return
        lop = self.linkops.pop(msg.op_id, None)
        if lop is not None:
            self._finish_connect(lop, msg, now)
            return
        if msg.op_id.startswith("pre-"):
            return  # the measurement of a connect-link that was refused or timed out
        if self.checks.take(msg, now):
            return  # a confirming probe
        if msg.up and self.monitor.link(msg.sender, j) is not None:  # bandwidth refinement
            self.checks.refine(msg, now)

    def data_plane_changes(self) -> bool:
        """Whether the sync policy built from the monitor now differs from the last one issued."""
        return not same_data_plane(self.last_sync, self.current_sync())

    def current_sync(self) -> SyncPolicyWire:
        """The sync policy the monitor gives now, with the members' data endpoints."""
        policy = sync_policy(self.monitor, self.cfg, self.last_sync)
        return to_wire(policy, data_addresses(self.monitor, policy.nodes))

    def _finish_connect(self, lop: LinkOp, msg: LinkReport, now: float) -> None:
        a, b = lop.req.a, lop.req.b
        if not msg.up or not self.monitor.has(a) or not self.monitor.has(b):
            self._fail(lop.reply, lop.req.op_id, Reason.UNREACHABLE, f"{a} cannot reach {b}")
            return
        self.monitor.set_link(a, b, up=True, latency_s=msg.latency_s)
        op = self.commit(
            "connect_link", now, reply=lop.reply, req_op_id=lop.req.op_id, started=lop.started
        )
        # the bandwidth probe (a bulk transfer) starts once every member has the new policy
        op.then = functools.partial(self.order_bandwidth_probe, a, b)

    def order_bandwidth_probe(self, a: str, b: str, prefix: str = "refine-") -> str | None:
        """Asks ``a`` to measure its link to ``b``; returns the operation id (``None``: either
        node is gone)."""
        if not (self.monitor.has(a) and self.monitor.has(b)):
            return None
        op_id = prefix + uuid.uuid4().hex[:8]
        self.host.send(
            a,
            ConnectCommand(
                sender=self.host.node_id,
                epoch=self.epoch,
                term=self.host.term,
                peer=b,
                address=self.monitor.address(b),
                measure_bandwidth=True,
                op_id=op_id,
            ),
        )
        return op_id

    # -- timers ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Times out primitives, joins and link operations; commits held allreduce restarts."""
        for op in list(self.ops.values()):
            if now > op.deadline:
                self._complete(op, now, ok=False, reason=Reason.TIMEOUT)
        for op_id, lop in list(self.linkops.items()):
            if now > lop.deadline:
                self.linkops.pop(op_id)
                self._fail(lop.reply, lop.req.op_id, Reason.TIMEOUT, "link measurement timed out")
        for j in [j for j, so in self.scaleouts.items() if now > so.deadline]:
            self._finish_scaleout(j, now)
        self.trainers.tick(now)


def _majority_acked(members: frozenset[str], acked: dict[str, int], epoch: int) -> bool:
    return 2 * sum(1 for m in members if acked.get(m, 0) >= epoch) > len(members)
