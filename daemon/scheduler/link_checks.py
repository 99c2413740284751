"""Bandwidth refinements of links already up, run by the scheduler.

After a connect-link or a scale-out, and whenever an end re-measures a link, a
:class:`~chaos.protocol.LinkReport` brings a bandwidth figure. The monitor takes it; an epoch is
committed only if the data plane (the sync policy's trees and rings) changes, and such a change
is first confirmed by fresh probes taken together (:class:`LinkCheck`), since one probe on a busy
host measures the CPU more than the link.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from chaos.daemon.context import Context
from chaos.daemon.scheduler.ledger import EpochLedger
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.planner import policy_edges, same_data_plane

from chaos.protocol import LinkReport


class ProbeOrders(Protocol):
    """Orders a bandwidth probe of a link."""

    def order_bandwidth_probe(  # noqa: D102
        self, a: str, b: str, prefix: str = "refine-"
    ) -> str | None: ...


_MAX_PENDING = 64
"""Confirming bandwidth probes remembered at most; the oldest (never answered: its node left or
failed) is forgotten first."""


@dataclass
class LinkCheck:
    """A measurement that would re-wire the data plane, being checked: a second probe of the new
    link, and fresh probes of the links the new structure would drop, all ordered at once so
    that they measure under the same conditions."""

    link: frozenset[str]
    first: float
    """The first measurement of ``link`` (bit/s); it counts at the lower of its two figures."""
    pending: set[str]
    """Op ids of the probes not answered yet."""
    reports: list[LinkReport] = field(default_factory=list)


class LinkChecks:
    """The scheduler's link refinements and the checks of changes they would make.

    Args:
        ctx: The daemon's context (its event log).
        monitor: The cluster monitor (the links' figures).
        ledger: The policy in force, and the commits.
        probes: Orders the confirming probes.
    """

    def __init__(
        self, ctx: Context[Any], monitor: ClusterMonitor, ledger: EpochLedger, probes: ProbeOrders
    ) -> None:
        self.ctx = ctx
        self.monitor = monitor
        self.ledger = ledger
        self.probes = probes
        self.pending: dict[str, LinkCheck] = {}
        """Checks by the op id of each probe not answered yet."""

    def take(self, msg: LinkReport, now: float) -> bool:
        """Takes ``msg`` if it answers a check's probe (settling the check when it was the
        last); returns whether it did."""
        check = self.pending.pop(msg.op_id, None)
        if check is None:
            return False
        check.pending.discard(msg.op_id)
        check.reports.append(msg)
        if not check.pending:
            self._settle(check, now)
        return True

    def refine(self, msg: LinkReport, now: float) -> None:
        """Takes a link's bandwidth measurement; commits only if the data plane changes.

        A measurement that would change the data plane (every trainer re-wires) is not taken
        at once: a second probe of the link and fresh probes of the links the new structure
        would drop are ordered together (event ``link_confirming``), and the change is decided
        on those (:meth:`_settle`). One probe on a busy host measures the CPU more than
        the link (loopback "links" vary from 1 to 14 Gbit/s with the load), so a new link
        measured while the host was quiet would otherwise look faster than old links measured
        while it was busy; and a switch that noise caused costs every member a re-wired step.

        Args:
            msg: The measurement (of the link ``msg.sender``-``msg.peer``).
            now: The current time.
        """
        ledger, mon = self.ledger, self.monitor
        a, b = msg.sender, msg.peer
        bw = msg.bandwidth_bps
        before = mon.link(a, b) or {}
        mon.set_link(a, b, up=True, latency_s=msg.latency_s, bandwidth_bps=bw)
        current = ledger.current_sync()
        if same_data_plane(ledger.last_sync, current):
            self._refined(a, b, bw, msg.latency_s)
            return
        if bw is not None:
            mon.set_bandwidth(a, b, before.get("bandwidth_bps"))
            dropped = policy_edges(ledger.last_sync) - policy_edges(current) - {frozenset((a, b))}
            pairs = [(a, b)] + [tuple(sorted(e)) for e in dropped if mon.link(*e)]
            ops = [self.probes.order_bandwidth_probe(x, y, prefix="confirm-") for x, y in pairs]
            if ops[0] is not None:
                check = LinkCheck(frozenset((a, b)), bw, {o for o in ops if o is not None})
                for op_id in check.pending:
                    if len(self.pending) >= _MAX_PENDING:  # forget the oldest
                        self.pending.pop(next(iter(self.pending)))
                    self.pending[op_id] = check
                self.ctx.event("link_confirming", a=a, b=b, bandwidth_bps=bw,
                               rechecked=[list(p) for p in pairs[1:]])  # fmt: skip
                return
        ledger.commit("link_measured", now)

    def _settle(self, check: LinkCheck, now: float) -> None:
        """Every probe of a check answered: the links take their fresh figures (the new link
        the lower of its two), and an epoch is committed if the data plane still changes."""
        ledger, mon = self.ledger, self.monitor
        for r in check.reports:
            pair = frozenset((r.sender, r.peer))
            if not r.up or r.bandwidth_bps is None or mon.link(r.sender, r.peer) is None:
                continue  # a link that went down is reported (and handled) on its own
            bw = min(r.bandwidth_bps, check.first) if pair == check.link else r.bandwidth_bps
            mon.set_link(r.sender, r.peer, up=True, latency_s=r.latency_s,
                                 bandwidth_bps=bw)  # fmt: skip
        if ledger.data_plane_changes():
            ledger.commit("link_measured", now)
        else:
            a, b = sorted(check.link)
            link = mon.link(a, b) or {}
            self._refined(a, b, link.get("bandwidth_bps"), link.get("latency_s"))

    def _refined(self, a: str, b: str, bw: float | None, latency_s: float | None) -> None:
        """Logs a measurement of a-b that left the trees and rings as they were: no epoch, so
        no trainer installs (or reruns) anything."""
        self.ctx.event("link_refined", a=a, b=b, bandwidth_bps=bw, latency_s=latency_s,
                            epoch=self.ledger.epoch)  # fmt: skip
