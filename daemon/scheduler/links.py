"""Connect-link and disconnect-link (paper IV-B, Fig. 4), and the scheduler's probe orders.

* **connect-link**: one end connects and pings; the policy is issued; the bandwidth is measured
  afterwards (overlapping training); a ``link_measured`` update follows only when the measurement
  changes the sync policy's structure (:mod:`chaos.daemon.scheduler.link_checks`).
* **disconnect-link**: requested (``after_allreduce``; refused if it would disconnect the
  overlay) or a failed probe (``before_next_allreduce`` with restart; the link stays, marked
  down).
* **a link the allreduce found failing**: when a trainer's round fails on a neighbour whose
  daemon is heard and no straggler explains it, the link between the two is checked at once
  (one end pings the other, as for a connect-link); no answer marks it down with a
  disconnect-link (restart), as a failed probe does, instead of restarting the round over the
  same dead link until the periodic probes notice (events ``link_verify``, ``link_down`` with
  ``by: allreduce``).
* **flap damping**: a link that a probe reports down again soon after it came back up
  (within ``FLAP_WINDOW`` link failure timeouts) is a flapping link: its next recovery is
  accepted only after a hold of ``link_failure_timeout_s`` doubled for each flap in a row (at
  most 32 times); until then the member's ``probe_recovered`` is refused (``link_damped``) and
  re-sent by the member later. One flap costs two commits, not a commit per probe.
* **healing**: when a failure, a leave or a link loss has split the overlay of active members,
  the scheduler itself orders a connect-link across the cut, best candidate pair first
  (:mod:`chaos.daemon.scheduler.healing`); a pair that cannot reach each other is skipped for
  the next one, until the overlay is whole again.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Any

from chaos.daemon.context import Context
from chaos.daemon.scheduler.healing import candidate_pairs, components
from chaos.daemon.scheduler.ledger import EpochLedger
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.transport import ReplyPath

from chaos.protocol import ConnectCommand, LinkReport, LinkRequest, Reason

FLAP_WINDOW = 10.0
"""A link that goes down again within this many link failure timeouts of coming back up
flaps."""


@dataclass
class _Flaps:
    """A link's recent failures: the flaps in a row and when its recovery may be accepted."""

    count: int
    hold_until: float
    up_at: float | None = None


@dataclass
class LinkOp:
    """A connect-link waiting for its link report."""

    req: LinkRequest
    reply: ReplyPath | None
    started: float
    deadline: float


class LinkOps:
    """The link primitives in progress, and the probe orders.

    Args:
        ctx: The daemon's context (identity, term, sends, events; ``probe_timeout_s``).
        monitor: The cluster monitor.
        ledger: Commits the link changes and answers their requesters.
    """

    def __init__(
        self, ctx: Context[Any], monitor: ClusterMonitor, ledger: EpochLedger
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.monitor = monitor
        self.ledger = ledger
        self.pending: dict[str, LinkOp] = {}
        self._healing: str | None = None  # the op id of the heal in progress
        self._tried: set[frozenset[str]] = set()  # pairs found unreachable during this split
        self._next_heal_check = 0.0
        self._flaps: dict[frozenset[str], _Flaps] = {}
        self._verifying: dict[str, frozenset[str]] = {}  # op id -> the link being checked

    def on_request(self, msg: LinkRequest, reply: ReplyPath | None, now: float) -> None:
        """Connect-link or disconnect-link."""
        a, b = msg.a, msg.b
        if a == b or not self.monitor.has(a) or not self.monitor.has(b):
            self.ledger.refuse(reply, msg.op_id, Reason.UNKNOWN_PEER, f"link {a}-{b}: unknown node")
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
            self.ledger.refuse(reply, msg.op_id, Reason.BAD_REQUEST, "link already up")
            return
        if msg.reason == "probe_recovered" and link is not None:
            flaps = self._flaps.get(frozenset((msg.a, msg.b)))
            if flaps is not None and now < flaps.hold_until:
                self.ctx.event("link_damped", a=msg.a, b=msg.b, flaps=flaps.count,
                                hold_s=flaps.hold_until - now)  # fmt: skip
                self.ledger.refuse(reply, msg.op_id, Reason.BAD_REQUEST,
                                   "link_damped: the link flaps; its recovery is held")  # fmt: skip
                return
            if flaps is not None:
                flaps.up_at = now
            self.monitor.set_link(msg.a, msg.b, up=True)
            self.ledger.commit("connect_link", now, reply=reply, req_op_id=msg.op_id)
            return
        if msg.premeasured and msg.sender == msg.a:  # a measures it and reports by itself
            self.pending["pre-" + msg.op_id] = LinkOp(
                msg, reply, now, now + self.cfg.probe_timeout_s
            )
            return
        op_id = uuid.uuid4().hex[:12]
        self.pending[op_id] = LinkOp(msg, reply, now, now + self.cfg.probe_timeout_s)
        self._order_probe(msg.a, msg.b, op_id, measure_bandwidth=False)

    def _disconnect(
        self, msg: LinkRequest, link: dict[str, object] | None, reply: ReplyPath | None, now: float
    ) -> None:
        ledger = self.ledger
        if link is None or (msg.reason == "probe_failed" and not link["up"]):
            ledger.refuse(reply, msg.op_id, Reason.BAD_REQUEST, "no such link up")
            return
        if msg.reason == "probe_failed":
            self._count_flap(frozenset((msg.a, msg.b)), now)
            self.monitor.set_link(msg.a, msg.b, up=False)
            self.ctx.event("link_down", a=msg.a, b=msg.b)
            ledger.commit(
                "disconnect_link",
                now,
                apply_at="before_next_allreduce",
                restart=True,
                reply=reply,
                req_op_id=msg.op_id,
            )
            return
        if link["up"] and not self.monitor.connected_without(msg.a, msg.b):
            ledger.refuse(reply, msg.op_id, Reason.WOULD_DISCONNECT, "the overlay would split")
            return
        self.monitor.remove_link(msg.a, msg.b)
        ledger.commit("disconnect_link", now, reply=reply, req_op_id=msg.op_id)

    def take(self, msg: LinkReport, now: float) -> bool:
        """Takes the report a connect-link waits for (committing the link when it is up);
        returns whether ``msg`` was one."""
        lop = self.pending.pop(msg.op_id, None)
        if lop is None:
            return False
        a, b = lop.req.a, lop.req.b
        if self._verifying.pop(msg.op_id, None) is not None:
            self._verified(a, b, msg.up, now)
            return True
        if msg.op_id == self._healing:
            self._healing = None
            if not msg.up:
                self._tried.add(frozenset((a, b)))
                self.ctx.event("heal_unreachable", a=a, b=b)
                return True
            self.ctx.event("overlay_healed", a=a, b=b, latency_s=msg.latency_s)
        if not msg.up or not self.monitor.has(a) or not self.monitor.has(b):
            self.ledger.refuse(
                lop.reply, lop.req.op_id, Reason.UNREACHABLE, f"{a} cannot reach {b}"
            )
            return True
        self.monitor.set_link(a, b, up=True, latency_s=msg.latency_s)
        op = self.ledger.commit(
            "connect_link", now, reply=lop.reply, req_op_id=lop.req.op_id, started=lop.started
        )
        # the bandwidth probe (a bulk transfer) starts once every member has the new policy
        op.then = functools.partial(self.order_bandwidth_probe, a, b)
        return True

    def order_bandwidth_probe(self, a: str, b: str, prefix: str = "refine-") -> str | None:
        """Asks ``a`` to measure its link to ``b``; returns the operation id (``None``: either
        node is gone)."""
        if not (self.monitor.has(a) and self.monitor.has(b)):
            return None
        op_id = prefix + uuid.uuid4().hex[:8]
        self._order_probe(a, b, op_id, measure_bandwidth=True)
        return op_id

    def _order_probe(self, a: str, b: str, op_id: str, measure_bandwidth: bool) -> None:
        self.ctx.out.send(
            a,
            ConnectCommand(
                sender=self.ctx.node_id,
                epoch=self.ledger.epoch,
                term=self.ctx.facts.term,
                peer=b,
                address=self.monitor.address(b),
                measure_bandwidth=measure_bandwidth,
                op_id=op_id,
            ),
        )

    def verify(self, a: str, b: str, now: float) -> None:
        """Checks the overlay link ``a``-``b`` at once (``a`` pings ``b``) after an allreduce
        failed on it; no-op without such a link up, or while one check of it is pending."""
        link = self.monitor.link(a, b) if self.monitor.has(a) and self.monitor.has(b) else None
        key = frozenset((a, b))
        if link is None or not link["up"] or key in self._verifying.values():
            return
        op_id = "verify-" + uuid.uuid4().hex[:8]
        req = LinkRequest(sender=self.ctx.node_id, epoch=self.ledger.epoch, a=a, b=b,
                          op="disconnect", op_id=op_id)  # fmt: skip
        self.pending[op_id] = LinkOp(req, None, now, now + self.cfg.link_failure_timeout_s)
        self._verifying[op_id] = key
        self.ctx.event("link_verify", a=a, b=b)
        self._order_probe(a, b, op_id, measure_bandwidth=False)

    def _verified(self, a: str, b: str, up: bool, now: float) -> None:
        """The check of a link the allreduce failed on: down means a disconnect-link."""
        link = self.monitor.link(a, b) if self.monitor.has(a) and self.monitor.has(b) else None
        if up or link is None or not link["up"]:
            self.ctx.event("link_verified", a=a, b=b, up=up)
            return
        self._count_flap(frozenset((a, b)), now)
        self.monitor.set_link(a, b, up=False)
        self.ctx.event("link_down", a=a, b=b, by="allreduce")
        self.ledger.commit("disconnect_link", now, apply_at="before_next_allreduce", restart=True)

    def _count_flap(self, key: frozenset[str], now: float) -> None:
        """Records a link going down; sets the hold of its next recovery."""
        window = FLAP_WINDOW * self.cfg.link_failure_timeout_s
        f = self._flaps.get(key)
        if f is None or f.up_at is None or now - f.up_at > window:
            self._flaps[key] = _Flaps(count=0, hold_until=0.0)  # a first failure: no hold
            return
        f.count += 1
        f.hold_until = now + self.cfg.link_failure_timeout_s * 2.0 ** min(f.count - 1, 5)
        f.up_at = None

    def heal(self, now: float) -> None:
        """Orders a connect-link across the cut when the overlay of active members is split
        (one at a time, checked every heartbeat interval)."""
        if self._healing is not None or now < self._next_heal_check:
            return
        self._next_heal_check = now + self.cfg.heartbeat_interval_s
        members = self.monitor.members()
        damped = {k for k, f in self._flaps.items() if now < f.hold_until}
        pairs = candidate_pairs(self.monitor.g, members, self.cfg.default_bandwidth_bps,
                                self._tried | damped)  # fmt: skip
        if not pairs:
            if len(components(self.monitor.g, members)) < 2:
                self._tried.clear()  # whole again: a later split starts afresh
            return
        a, b = pairs[0]
        op_id = "heal-" + uuid.uuid4().hex[:8]
        req = LinkRequest(sender=self.ctx.node_id, epoch=self.ledger.epoch, a=a, b=b,
                          op="connect", op_id=op_id)  # fmt: skip
        self.pending[op_id] = LinkOp(req, None, now, now + self.cfg.probe_timeout_s)
        self._healing = op_id
        parts = components(self.monitor.g, members)
        self.ctx.event("heal_started", a=a, b=b, parts=parts)
        self._order_probe(a, b, op_id, measure_bandwidth=False)

    def tick(self, now: float) -> None:
        """Fails the connect-links whose measurement is overdue; heals a split overlay."""
        for op_id, lop in list(self.pending.items()):
            if now > lop.deadline:
                self.pending.pop(op_id)
                if op_id == self._healing:
                    self._healing = None
                    self._tried.add(frozenset((lop.req.a, lop.req.b)))
                    self.ctx.event("heal_unreachable", a=lop.req.a, b=lop.req.b)
                    continue
                if self._verifying.pop(op_id, None) is not None:
                    self._verified(lop.req.a, lop.req.b, False, now)  # no answer at all
                    continue
                self.ledger.refuse(
                    lop.reply, lop.req.op_id, Reason.TIMEOUT, "link measurement timed out"
                )
        self.heal(now)
