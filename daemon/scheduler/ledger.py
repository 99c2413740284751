"""The scheduler's epochs: commits, acknowledgements, and the primitives waiting for them.

A primitive ends in a *commit*: the epoch is bumped, the plan generator builds the new sync policy
(the replication plan comes with the primitive, or is the one still carried for a syncing
joiner), and a :class:`~chaos.protocol.ClusterUpdate` goes to every member. It completes when
every member acknowledged that epoch; its requester then gets an
:class:`~chaos.protocol.OpResult` with the control-path time.

The ledger also keeps the quorum base (:class:`~chaos.daemon.scheduler.quorum.QuorumBase`): the
membership of the newest committed epoch, in force at once, and the epochs a majority of their
own membership has not acknowledged yet (Raft's single-server membership changes).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from chaos.daemon.context import Context
from chaos.daemon.scheduler.batch_split import BatchSplitter
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.planner import (
    data_addresses,
    data_keys,
    same_data_plane,
    sync_policy,
    to_wire,
)
from chaos.daemon.scheduler.quorum import QuorumBase
from chaos.daemon.transport import ReplyPath

from chaos.errors import CounterLimit
from chaos.protocol import (
    MAX_COUNTER,
    ApplyAt,
    ClusterUpdate,
    OpResult,
    PolicyAck,
    Reason,
    ReplicationWire,
    SyncPolicyWire,
    TimeoutNow,
)


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


class EpochLedger:
    """Commits epochs and tracks their acknowledgements.

    Args:
        ctx: The daemon's context (identity, term, sends; ``op_timeout_s`` and the planner's
            settings in its config).
        monitor: The cluster monitor the views and policies are built from.
        epoch: The epoch committed last (0: none).
        carried: The replication plan a commit carries when its primitive brings none (that of
            a joiner still syncing), or ``None``.
    """

    def __init__(
        self,
        ctx: Context[Any],
        monitor: ClusterMonitor,
        epoch: int,
        carried: Callable[[], ReplicationWire | None],
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.monitor = monitor
        self.epoch = epoch
        self._carried = carried
        self.quorum = QuorumBase(monitor.members())
        self.acked: dict[str, int] = {}
        self.ops: dict[str, PendingOp] = {}
        self.last_sync: SyncPolicyWire | None = None
        self.last_update: ClusterUpdate | None = None
        # the global batch and the trainers' throughputs: every commit carries their split
        self.batches = BatchSplitter()

    @property
    def stable_members(self) -> frozenset[str]:
        """The quorum base: the membership of the newest committed epoch."""
        return self.quorum.members

    # -- the policy in force ---------------------------------------------------------------

    def current_sync(self) -> SyncPolicyWire:
        """The sync policy the monitor gives now, with the members' data endpoints."""
        policy = sync_policy(self.monitor, self.cfg, self.last_sync)
        nodes = policy.nodes
        return to_wire(policy, data_addresses(self.monitor, nodes), data_keys(self.monitor, nodes))

    def data_plane_changes(self) -> bool:
        """Whether the sync policy built from the monitor now differs from the last one issued."""
        return not same_data_plane(self.last_sync, self.current_sync())

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

        Args:
            cause: The primitive's name (the update's ``cause``).
            now: Monotonic time.
            apply_at: When the members apply the update.
            restart: Whether the allreduce in flight restarts.
            reply: Where the requester waits for the result.
            req_op_id: The requester's op id.
            replication: The replication plan the update carries.
            started: When the primitive started (default ``now``).

        Returns:
            The primitive, waiting for the members' acknowledgements.

        Raises:
            CounterLimit: The epoch is at :data:`~chaos.protocol.MAX_COUNTER`.
        """
        if self.epoch >= MAX_COUNTER:
            raise CounterLimit(f"epoch {self.epoch} is at the wire limit: no new commit")
        self.epoch += 1
        view = self.monitor.to_view(self.epoch, self.ctx.facts.term, self.ctx.node_id)
        sync = self.current_sync()
        sync = msgspec.structs.replace(sync, batch_sizes=self.batches.sizes(sync.nodes, now))
        if replication is None:
            replication = self._carried()
        sync = self._stamp_topology(sync, restart)
        restart = self._carry_restart(sync, restart)
        op_id = uuid.uuid4().hex[:12]
        upd = ClusterUpdate(
            sender=self.ctx.node_id,
            epoch=self.epoch,
            term=self.ctx.facts.term,
            view=view,
            sync=sync,
            replication=replication,
            apply_at=apply_at,
            restart_allreduce=restart,
            cause=cause,
            op_id=op_id,
            cert=self.ctx.facts.vote_cert,
        )
        self.last_update = upd
        members = set(self.monitor.members())
        start = started if started is not None else now
        op = self._track(cause, members, op_id, reply, req_op_id, start, now)
        self._announce(upd, members)
        return op

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
        """Records the committed epoch's membership and the primitive waiting for its acks.

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
        self.quorum.committed(self.epoch, members)
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

    def _carry_restart(self, sync: SyncPolicyWire, restart: bool) -> bool:
        """Whether the update restarts the allreduce: a restart commit does, and so does every
        later one that keeps the structure that restart stamped.

        A trainer waiting in a round reads only the newest policy it hears of. A restart
        superseded at once by a commit that keeps its structure (a joiner registering, say)
        would otherwise go unseen, and trainers still in the old round would wait it out to
        their step timeout. Repeating it is harmless: a trainer already rerunning under that
        structure epoch is not newer than it, and does not abort.

        Args:
            sync: The committed policy, its ``topology_epoch`` stamped.
            restart: Whether the commit itself restarts the allreduce.

        Returns:
            The update's ``restart_allreduce``.
        """
        prev = self.last_update
        return restart or (
            prev is not None
            and prev.restart_allreduce
            and prev.sync.topology_epoch == sync.topology_epoch
        )

    def _announce(self, upd: ClusterUpdate, members: set[str]) -> None:
        """Sends a committed update to every member and logs the ``committed`` event.

        Args:
            upd: The update.
            members: Its recipients.
        """
        self.ctx.out.broadcast(
            {m: self.monitor.address(m) for m in sorted(members)}, upd
        )  # encoded once, sent to every member (to itself through the local queue)
        self.ctx.event(
            "committed",
            cause=upd.cause,
            epoch=self.epoch,
            term=self.ctx.facts.term,
            members=sorted(members),
            sync_kind=upd.sync.kind,
            topology_epoch=upd.sync.topology_epoch,
            apply_at=upd.apply_at,
            restart_allreduce=upd.restart_allreduce,
            op_id=upd.op_id,
        )

    # -- acknowledgements ------------------------------------------------------------------

    def on_ack(self, msg: PolicyAck, now: float) -> None:
        """Counts a member's acknowledgement of an epoch."""
        self.acked[msg.sender] = max(self.acked.get(msg.sender, 0), msg.epoch)
        self.quorum.settle(self.acked)
        for op in list(self.ops.values()):
            if op.epoch <= msg.epoch:
                op.waiting.discard(msg.sender)
                if not op.waiting:
                    self.complete(op, now, ok=True)

    def wait_for_none_from(self, node: str, now: float) -> None:
        """Stops waiting for ``node``'s acknowledgements (it left or failed)."""
        for op in list(self.ops.values()):
            op.waiting.discard(node)
            if not op.waiting:
                self.complete(op, now, ok=True)

    def complete(self, op: PendingOp, now: float, ok: bool, reason: Reason | None = None) -> None:
        """Ends a primitive: answers its requester, logs it and runs its follow-up work."""
        if self.ops.pop(op.op_id, None) is None:
            return
        elapsed = now - op.started
        if op.reply is not None or op.req_op_id:  # the answer first, the bookkeeping after
            self.ctx.out.respond(
                op.reply,
                OpResult(
                    sender=self.ctx.node_id,
                    epoch=self.epoch,
                    op_id=op.req_op_id,
                    ok=ok,
                    reason=reason,
                    elapsed_s=elapsed,
                ),
            )
        self.ctx.event(
            "primitive_done",
            primitive=op.name,
            epoch=op.epoch,
            ok=ok,
            elapsed_s=elapsed,
            reason=reason,
        )
        if ok:
            self.ctx.metrics.primitive(op.name, elapsed)
        if op.then is not None:
            op.then()
        if op.after is not None:  # the scheduler itself has left
            self._hand_over(op.after, now)

    def _hand_over(self, after: TimeoutNow, now: float) -> None:
        """After the leaving scheduler's own leave: answers the other leavers whose views it
        committed (it will not be there to see those views acknowledged, and their leaves are
        done once committed), then tells a successor to start an election."""
        for other in [o for o in self.ops.values() if o.name == "scale_in_leave"]:
            self.complete(other, now, ok=True)
        target = min(self.monitor.members(), default=None)
        if target is not None:  # stamped now: a later commit made its epoch stale
            self.ctx.out.send(target, msgspec.structs.replace(after, epoch=self.epoch))

    def refuse(self, reply: ReplyPath | None, req_op_id: str, reason: Reason, detail: str) -> None:
        """Answers a primitive's requester that it was refused (nothing committed)."""
        self.ctx.event("primitive_refused", reason=reason, detail=detail)
        self.ctx.out.respond(
            reply,
            OpResult(
                sender=self.ctx.node_id,
                epoch=self.epoch,
                op_id=req_op_id,
                ok=False,
                reason=reason,
                detail=detail,
            ),
        )

    def tick(self, now: float) -> None:
        """Fails the primitives not acknowledged by their deadline."""
        for op in list(self.ops.values()):
            if now > op.deadline:
                self.complete(op, now, ok=False, reason=Reason.TIMEOUT)
