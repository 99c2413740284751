"""Scale-out (paper IV-B, Fig. 4): admitting a node that asks to join.

The joiner's neighbours connect to it and measure the links (latency and bandwidth); then the
replication and sync policies are issued (``after_allreduce``). A retry of a join in progress is
ignored; a restarted incarnation of a member (at its address, or once the old one is silent) is
scaled in and out again, its old trainer registration dropped; a join naming an unknown
neighbour, or under the id of a member still heard from at another address (``duplicate_id``),
is refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from chaos.daemon.context import Context
from chaos.daemon.scheduler.failures import FailureDetector
from chaos.daemon.scheduler.ledger import EpochLedger
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.planner import replication_policy
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    ConnectCommand,
    JoinRequest,
    LinkReport,
    Reason,
    Refusal,
    ReplicationWire,
)
from chaos.protocol.states import NodeState

NAT_HELP = "see 'Devices behind NAT' in docs/daemon.md"


def unreachable_detail(tried: str, address: str, timeout_s: float) -> str:
    """The words of a ``joiner_unreachable`` refusal: who tried, where, and what to do."""
    return (f"{tried} could not connect to {address}, the address this device advertises "
            f"(its --listen), within {timeout_s:g} s: the cluster's members must be able to "
            "open connections to it. A device behind NAT or a firewall cannot take part "
            "unless it is reachable there (forward the port, or listen on an address the "
            f"cluster can route to); {NAT_HELP}")  # fmt: skip


class JoinerRecords(Protocol):
    """The trainer registrations, as a join sees them."""

    def forget(self, node: str) -> None: ...  # noqa: D102

    def carried(self) -> ReplicationWire | None: ...  # noqa: D102


@dataclass
class ScaleOut:
    """A join in progress: waiting for the neighbours' link reports."""

    req: JoinRequest
    op_id: str
    started: float
    deadline: float
    waiting: set[str]
    reply: ReplyPath | None = None
    """The way the join came: a refusal goes back along it."""
    reports: dict[str, LinkReport] = field(default_factory=dict)


class ScaleOuts:
    """The joins in progress.

    Args:
        ctx: The daemon's context (identity, term, sends, events; ``probe_timeout_s`` and
            the replication settings).
        monitor: The cluster monitor.
        ledger: Commits the joiner's admission.
        liveness: When each member was last heard.
        trainers: The trainer registrations (a joiner's former incarnation is forgotten).
    """

    def __init__(
        self,
        ctx: Context[Any],
        monitor: ClusterMonitor,
        ledger: EpochLedger,
        liveness: FailureDetector,
        trainers: JoinerRecords,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.monitor = monitor
        self.ledger = ledger
        self.liveness = liveness
        self.trainers = trainers
        self.joins: dict[str, ScaleOut] = {}
        # when each joiner was admitted here (monotonic), and under which incarnation nonce
        self._admitted: dict[str, tuple[float, str]] = {}

    def on_join(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        """Starts a scale-out (or refuses it)."""
        j = msg.node_id
        if j in self.joins:
            return  # a retry of a join in progress
        if self.monitor.has(j) and not self._replace(msg, reply, now):
            return
        unknown = [n for n in msg.neighbors if not self.monitor.has(n)]
        known = [n for n in msg.neighbors if n not in unknown]
        if unknown and not known:
            self._refuse(msg, reply, Reason.UNKNOWN_PEER, f"unknown neighbor(s) {unknown}")
            return
        # a named neighbour that is no member (removed since the joiner chose it) is left out
        # while another one is: the joiner comes in through the others (event field dropped)
        nbrs = known or [msg.forwarded_by or self.ctx.node_id]
        self.monitor.add_node(j, msg.address, NodeState.JOINING, time.time(), msg.public_key,
                              msg.sign_key)  # fmt: skip
        so = ScaleOut(msg, uuid.uuid4().hex[:12], now, now + self.cfg.probe_timeout_s + 1.0,
                      set(nbrs), reply)  # fmt: skip
        self.joins[j] = so
        self.ctx.event("scale_out_started", peer=j, neighbors=nbrs, op_id=so.op_id,
                        dropped=unknown)  # fmt: skip
        for n in nbrs:
            self.ctx.out.send(
                n,
                ConnectCommand(
                    sender=self.ctx.node_id,
                    epoch=self.ledger.epoch,
                    term=self.ctx.facts.term,
                    peer=j,
                    address=msg.address,
                    measure_bandwidth=True,
                    op_id=so.op_id,
                ),
            )

    def _replace(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> bool:
        """A join under the id of a member: whether to admit it anew in place of the member.

        At another address, while the member is still heard from: refused (``duplicate_id``),
        as the member may be alive. Under another key than the one bound to the id, while the
        member is still heard from: refused ``id_in_use``, which the joiner retries (a
        restarted device's new incarnation is admitted once its old one falls silent; a key
        holder that names a live member's id never is). At its own address, under the
        incarnation nonce it was admitted with, within ``failure_timeout_s`` of its admission:
        the joiner missed its admission, which is sent again. Otherwise it is a restarted
        incarnation (the old one is treated as failed: scaled in with its trainer registration,
        and the new one scaled out).
        """
        j = msg.node_id
        fresh = self.liveness.fresh(j, now)
        if self.monitor.address(j) != msg.address and fresh:
            self._refuse(msg, reply, Reason.DUPLICATE_ID, f"{j} is a member at another address")
            return False
        if fresh and self.monitor.public_key(j) != msg.public_key:
            self._refuse(msg, reply, Reason.ID_IN_USE, f"{j} is a member still heard from under "
                         "another key: retry once that incarnation is gone")  # fmt: skip
            return False
        at, incarnation = self._admitted.get(j, (float("-inf"), ""))
        retry = incarnation == msg.incarnation and now - at <= self.cfg.failure_timeout_s
        if fresh and retry and self.ledger.last_update is not None:
            self.ctx.out.send(j, self.ledger.last_update)  # the joiner missed its admission
            return False
        self.ctx.event("incarnation_replaced", peer=j, was_fresh=fresh)
        self.monitor.remove_node(j)  # a restarted incarnation: scale it in and out again
        self.trainers.forget(j)
        self._admitted.pop(j, None)
        return True

    def _refuse(
        self, msg: JoinRequest, reply: ReplyPath | None, reason: Reason, detail: str
    ) -> None:
        """Refuses a join back the way it came: over the connection the joiner opened (a
        joiner behind NAT cannot be dialled), or, for a forwarded join, to the member that
        forwarded it, naming the joiner, which that member hands it on to. Without a way back
        (none recorded) it goes to the joiner's advertised address."""
        self.ctx.event("join_refused", peer=msg.node_id, reason=reason, detail=detail)
        forwarded = msg.forwarded_by is not None and msg.forwarded_by != self.ctx.node_id
        no = Refusal(sender=self.ctx.node_id, epoch=self.ledger.epoch, reason=reason,
                     detail=detail, ref_type="join_request", term=self.ctx.facts.term,
                     joiner=msg.node_id if forwarded else None)  # fmt: skip
        if reply is not None:
            self.ctx.out.respond(reply, no)
        else:
            self.ctx.out.send_to_address(msg.node_id, msg.address, msgspec.structs.replace(
                no, joiner=None))  # fmt: skip

    def take(self, msg: LinkReport, now: float) -> bool:
        """Takes a neighbour's measurement of a joiner's link (admitting the joiner when it
        was the last awaited); returns whether ``msg`` was one."""
        so = self.joins.get(msg.peer)
        if so is None or msg.op_id != so.op_id:
            return False
        so.reports[msg.sender] = msg
        so.waiting.discard(msg.sender)
        if not so.waiting:
            self._finish(msg.peer, now)
        return True

    def forget(self, node: str) -> None:
        """Stops waiting for the link reports of a neighbour that left or failed."""
        for so in self.joins.values():
            so.waiting.discard(node)
        self._admitted.pop(node, None)

    def _finish(self, j: str, now: float) -> None:
        so = self.joins.pop(j)
        up = {n: r for n, r in so.reports.items() if r.up and self.monitor.has(n)}
        if not self.monitor.has(j):
            self._refuse(so.req, so.reply, Reason.UNREACHABLE, "the joiner was removed")
            return
        if not up:
            self.monitor.remove_node(j)
            tried = ", ".join(sorted(so.reports) or sorted(so.waiting)) or "no member"
            self._refuse(so.req, so.reply, Reason.JOINER_UNREACHABLE,
                         unreachable_detail(tried, so.req.address, self.cfg.probe_timeout_s))
            return
        for n, r in up.items():
            self.monitor.set_link(
                n, j, up=True, latency_s=r.latency_s, bandwidth_bps=r.bandwidth_bps
            )
        self.monitor.set_state(j, NodeState.ACTIVE)
        self.liveness.heard(j, now)
        self._admitted[j] = (now, so.req.incarnation)
        links = {n: (r.latency_s, r.bandwidth_bps) for n, r in up.items()}
        repl = replication_policy(j, links, so.req.state_bytes, so.req.tensor_sizes, self.cfg)
        self.ctx.event(
            "replication_planned",
            peer=j,
            skipped=repl.skipped,
            shard_size=repl.shard_size,
            makespan_s=repl.makespan_s,
        )
        if repl.skipped:  # keep carrying the plan of a trainer still syncing, if any
            repl = self.trainers.carried() or repl
        self.ledger.commit("scale_out", now, replication=repl, started=so.started)

    def tick(self, now: float) -> None:
        """Admits (or refuses) the joins whose neighbours' reports are overdue."""
        for j in [j for j, so in self.joins.items() if now > so.deadline]:
            self._finish(j, now)
