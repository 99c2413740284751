"""The node agent: heartbeats, link probes, link measurements and local resources.

* **Heartbeats** go to the scheduler every ``heartbeat_interval_s`` (the scheduler's own
  heartbeats go the other way, see :mod:`chaos.daemon.node`).
* **Light link probes**: a ping every ``link_probe_interval_s`` on each overlay link. A link with
  no answer for ``link_failure_timeout_s`` is reported down as *disconnect-link* (reason
  ``probe_failed``), never as a node failure; an answer on a down link reports it back up.
* **Measurements** (on a :class:`~chaos.protocol.ConnectCommand`: scale-out and connect-link):
  latency by ping-pong, then, if asked, bandwidth by a timed in-process bulk transfer of
  ``bandwidth_probe_bytes`` (iperf-like). Only then is the link reported to the scheduler.
  A bandwidth measurement of a link that is already connected, whose latency is known (its
  probes, or a measurement of the last ``_LATENCY_REUSE_S``), skips the pings.
* **Resources** via psutil: CPU, memory and battery where present. A sample that fails (e.g.
  ``EMFILE``: no file descriptor left to read ``/proc``) keeps the last one.

A ``ConnectCommand`` never re-points the connection of a peer this node already has at another
address (that would let whoever sent it redirect a member's traffic): it is refused, logged,
written as the event ``connect_refused`` and reported down. At most ``max_measurements`` run at
once; one beyond is reported down at once (the event ``overloaded``).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import psutil
from chaos.daemon.config import DaemonConfig
from chaos.daemon.dispatch import Handler, scheduler_side
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.transport import ReplyPath

from chaos.allocator import keep_frame_memory
from chaos.protocol import (
    AgentReport,
    BulkAck,
    BulkData,
    ClusterView,
    ConnectCommand,
    LinkReport,
    LinkRequest,
    Ping,
    Pong,
    Resources,
)

log = logging.getLogger("chaos.daemon.agent")

_MEASURE_RETRY_S = 0.05
_MEASURE_PINGS = 3
_LATENCY_REUSE_S = 10.0
"""A bandwidth measurement of a warm link reuses a latency measured this recently instead of
pinging again. Every message wakes threads on both ends, which costs CPU on a small host, and
the pings repeated what the connect-link's first measurement had just found."""


@dataclass
class LinkProbe:
    """Probe state of one overlay link, as this end sees it."""

    peer: str
    up: bool
    last_pong: float
    latency_s: float | None = None
    reported_up: bool = True
    last_report: float = float("-inf")


@dataclass
class Measurement:
    """A link measurement ordered by the scheduler."""

    cmd: ConnectCommand
    started: float
    deadline: float
    seq: int
    rtt_s: float | None = None
    pongs: int = 0
    probe_id: str = ""
    bulk_started: float = 0.0
    bulk_bytes: int = 0
    last_ping: float = float("-inf")
    burst_sent: bool = False
    pinged: bool = True
    """``False`` when the round trip was taken from an earlier measurement (no pings)."""

    @property
    def answered(self) -> bool:
        """Whether a pong came back: a measurement that times out is reported up only then (an
        answered bulk transfer completes it before its deadline)."""
        return self.pinged and self.pongs > 0


@dataclass
class _Incoming:
    first: float
    received: int = 0


@dataclass
class Agent:
    """One node's agent.

    Args:
        ctx: The daemon's context (facts, sending, events).
        cfg: Probe and heartbeat settings.
    """

    ctx: DaemonContext
    cfg: DaemonConfig
    links: dict[str, LinkProbe] = field(default_factory=dict)
    measurements: dict[int, Measurement] = field(default_factory=dict)
    measured: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    """Peer -> (latency_s, bandwidth_bps) of this node's latest completed measurement."""
    latencies: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Peer -> (latency_s, when) of this node's latest pinged measurement, with or without
    bandwidth (a connect-link's first measurement has none)."""
    incoming: dict[str, _Incoming] = field(default_factory=dict)
    resources: Resources | None = None
    overloaded: int = 0
    """Connect commands refused because ``max_measurements`` were in progress."""
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self._chunk = bytes(self.cfg.bandwidth_probe_chunk_bytes)
        if self.cfg.keep_probe_memory:
            # ZeroMQ allocates each received probe chunk anew: reuse the memory instead of
            # having the kernel zero 4 MiB of fresh pages per probe
            keep_frame_memory(self.cfg.bandwidth_probe_chunk_bytes)
        psutil.cpu_percent(interval=None)  # prime the non-blocking CPU sampler

    # -- view ------------------------------------------------------------------------------

    def set_view(self, view: ClusterView, now: float) -> None:
        """Tracks the overlay links this node has in ``view`` (up or down)."""
        me = self.ctx.node_id
        wanted: dict[str, bool] = {}
        for link in view.links:
            if me in (link.a, link.b):
                wanted[link.b if link.a == me else link.a] = link.up
        for peer in list(self.links):
            if peer not in wanted:
                del self.links[peer]
        for peer in [p for p in self.measured if p not in wanted]:
            del self.measured[peer]  # the link is gone: a later one is measured anew
        for peer, up in wanted.items():
            cur = self.links.get(peer)
            if cur is None:
                self.links[peer] = LinkProbe(peer, up=up, last_pong=now, reported_up=up)
            else:
                cur.reported_up = up

    def handlers(self) -> dict[type, Handler]:
        """The links flow: probes and measurements on this node (pings, a measurement's
        order and its bulk transfer), and the link requests, reports and agent reports the
        scheduler's side takes."""
        side = self.ctx.facts
        return {
            ConnectCommand: lambda m, r, t: self.on_connect(m, t),  # never re-points a peer
            Ping: self.on_ping,
            Pong: lambda m, r, t: self.on_pong(m, t),
            BulkData: self.rpc_bulk_data,
            BulkAck: lambda m, r, t: self.on_bulk_ack(m, t),
            LinkRequest: scheduler_side(side, lambda n, m, r, t: n.on_link_request(m, r, t)),
            LinkReport: scheduler_side(side, lambda n, m, r, t: n.on_link_report(m, t)),
            AgentReport: scheduler_side(side, lambda n, m, r, t: n.on_agent_report(m, t)),
        }

    def on_ping(self, msg: Ping, reply: ReplyPath | None, now: float) -> None:
        """Answers a ping with a pong carrying its sequence number and time."""
        pong = Pong(sender=self.ctx.node_id, epoch=self.ctx.facts.epoch, seq=msg.seq, t=msg.t)
        self.ctx.out.respond(reply, pong)

    def rpc_bulk_data(self, msg: BulkData, reply: ReplyPath | None, now: float) -> None:
        """Takes a chunk of a bandwidth probe; the last one is acknowledged."""
        ack = self.on_bulk_data(msg, now)
        if ack is not None:
            self.ctx.out.respond(reply, ack)

    def report(
        self, view: ClusterView | None, address: str, trainer: dict[str, object]
    ) -> AgentReport | None:
        """What this agent knows about itself, for a newly elected scheduler.

        Args:
            view: The last installed view (``None``: not a member; no report).
            address: This daemon's address.
            trainer: The trainer fields (``TrainerRelay.report_fields``).

        Returns:
            The report, or ``None`` when this node is not in ``view``.
        """
        me = self.ctx.node_id
        mine = next((n for n in view.nodes if n.id == me), None) if view else None
        if view is None or mine is None:
            return None
        links = []
        for link in view.links:
            if me in (link.a, link.b):
                probe = self.links.get(link.b if link.a == me else link.a)
                up = probe.up if probe is not None else link.up
                lat = probe.latency_s if probe is not None and probe.latency_s else link.latency_s
                links.append(msgspec.structs.replace(link, up=up, latency_s=lat))
        return AgentReport(
            sender=me,
            epoch=self.ctx.facts.epoch,
            term=self.ctx.facts.term,
            address=address,
            joined_at=mine.joined_at,
            links=links,
            resources=self.resources,
            **trainer,  # type: ignore[arg-type]
        )

    # -- periodic --------------------------------------------------------------------------

    def sample_resources(self) -> Resources | None:
        """Samples CPU, memory and battery (non-blocking); keeps the last sample when psutil
        fails (e.g. no file descriptor left to read ``/proc``)."""
        try:
            return self._sample()
        except (OSError, psutil.Error) as exc:
            log.warning("resource sample failed, keeping the last one: %s", exc)
            return self.resources

    def _sample(self) -> Resources:
        vm = psutil.virtual_memory()
        battery = None
        try:
            b = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
            battery = float(b.percent) if b is not None else None
        except (OSError, RuntimeError):
            battery = None
        self.resources = Resources(
            cpu_percent=float(psutil.cpu_percent(interval=None)),
            memory_percent=float(vm.percent),
            memory_available_bytes=int(vm.available),
            battery_percent=battery,
        )
        return self.resources

    def probe_links(self, now: float) -> None:
        """Sends the light latency pings and reports links whose state changed."""
        for probe in self.links.values():
            self.ctx.out.send(
                probe.peer, Ping(sender=self.ctx.node_id, epoch=self.ctx.facts.epoch, seq=0, t=now)
            )
            if probe.up and now - probe.last_pong > self.cfg.link_failure_timeout_s:
                probe.up = False
                self.ctx.event("link_probe_failed", peer=probe.peer)
            self._maybe_report(probe, now)

    def _maybe_report(self, probe: LinkProbe, now: float) -> None:
        if probe.up == probe.reported_up:
            return
        if now - probe.last_report < 2 * self.cfg.failure_timeout_s:
            return  # a request is in flight; re-send only if it was lost
        probe.last_report = now
        req = LinkRequest(
            sender=self.ctx.node_id,
            epoch=self.ctx.facts.epoch,
            a=self.ctx.node_id,
            b=probe.peer,
            op="disconnect",
            reason="probe_failed",
            op_id=uuid.uuid4().hex[:12],
        )
        if probe.up:
            req = msgspec.structs.replace(req, op="connect", reason="probe_recovered")
        self.ctx.out.to_scheduler(req)

    # -- pings -----------------------------------------------------------------------------

    def on_pong(self, msg: Pong, now: float) -> None:
        """Records a pong: link liveness, latency, or a measurement's round trip."""
        rtt = max(0.0, now - msg.t)
        if msg.seq == 0:
            probe = self.links.get(msg.sender)
            if probe is None:
                return
            probe.last_pong = now
            probe.latency_s = (
                rtt / 2 if probe.latency_s is None else 0.8 * probe.latency_s + 0.1 * rtt
            )
            if not probe.up:
                probe.up = True
                self.ctx.event("link_probe_recovered", peer=msg.sender)
                self._maybe_report(probe, now)
            return
        m = self.measurements.get(msg.seq)
        if m is None or m.pongs >= _MEASURE_PINGS or msg.sender != m.cmd.peer:
            return
        # the first round trip may include connection setup: keep the best of a few. Once the
        # first pong shows the connection is up, the others go out back to back (one more
        # round trip in all, not one per ping).
        m.rtt_s = rtt if m.rtt_s is None else min(m.rtt_s, rtt)
        m.pongs += 1
        if not m.burst_sent:
            m.burst_sent = True
            for _ in range(_MEASURE_PINGS - 1):
                self._ping(m, now)
        if m.pongs < _MEASURE_PINGS:
            return
        if m.cmd.measure_bandwidth:
            self._start_bulk(m, now)
        else:
            self._finish(m, now, up=True)

    # -- measurements ----------------------------------------------------------------------

    def on_connect(self, cmd: ConnectCommand, now: float) -> None:
        """Starts measuring the link to ``cmd.peer`` (ping, then maybe bulk).

        Refused (reported down at once) when it would re-point an open connection to another
        address, or when ``max_measurements`` are in progress already.
        """
        current = self.ctx.out.peer_address(cmd.peer)
        if current is not None and current != cmd.address:
            log.warning(
                "refused a connect_command from %r: it would re-point %s from %s to %s",
                cmd.sender, cmd.peer, current, cmd.address,
            )  # fmt: skip
            self.ctx.event("connect_refused", peer=cmd.peer, sender=cmd.sender,
                            address=cmd.address, current=current, op_id=cmd.op_id)  # fmt: skip
            self._report_down(cmd)
            return
        if len(self.measurements) >= self.cfg.max_measurements:
            self.overloaded += 1
            if self.overloaded == 1 or self.overloaded % 100 == 0:
                log.warning("%d link measurements in progress: %d connect_commands refused so "
                            "far", len(self.measurements), self.overloaded)  # fmt: skip
                self.ctx.event("overloaded", budget="measurements", refused=self.overloaded)
            self._report_down(cmd)
            return
        warm = self.ctx.out.connect_peer(cmd.peer, cmd.address)
        seq = next(self._seq)
        m = Measurement(cmd=cmd, started=now, deadline=now + self.cfg.probe_timeout_s, seq=seq)
        self.measurements[seq] = m
        latency = self._known_latency(cmd.peer, now) if warm and cmd.measure_bandwidth else None
        if latency is not None:
            # the round trip is known (the link's probes, or the measurement that connected
            # it a moment ago): time the transfer at once instead of pinging again
            m.rtt_s, m.pongs, m.burst_sent, m.pinged = 2 * latency, _MEASURE_PINGS, True, False
            self._start_bulk(m, now)
            return
        # over a connection already open, every ping goes out at once (one round trip); a fresh
        # one is pinged once first, so that connection setup inflates only one sample
        m.burst_sent = warm
        for _ in range(_MEASURE_PINGS if warm else 1):
            self._ping(m, now)

    def _report_down(self, cmd: ConnectCommand) -> None:
        """Reports a link it will not measure as down, so that its scale-out is not held up."""
        self.ctx.out.to_scheduler(
            LinkReport(
                sender=self.ctx.node_id,
                epoch=self.ctx.facts.epoch,
                term=self.ctx.facts.term,
                peer=cmd.peer,
                up=False,
                op_id=cmd.op_id,
            )
        )

    def _known_latency(self, peer: str, now: float) -> float | None:
        """The latency to ``peer`` from its link probes, else from a measurement taken within
        ``_LATENCY_REUSE_S``; ``None`` when neither is known."""
        probe = self.links.get(peer)
        if probe is not None and probe.up and probe.latency_s is not None:
            return probe.latency_s
        known = self.latencies.get(peer)
        if known is not None and now - known[1] <= _LATENCY_REUSE_S:
            return known[0]
        return None

    def _ping(self, m: Measurement, now: float) -> None:
        m.last_ping = now
        self.ctx.out.send(
            m.cmd.peer, Ping(sender=self.ctx.node_id, epoch=self.ctx.facts.epoch, seq=m.seq, t=now)
        )

    def tick_measurements(self, now: float) -> None:
        """Retries pings of fresh connections and times measurements out."""
        for m in list(self.measurements.values()):
            if now >= m.deadline:
                self._finish(m, now, up=m.answered)
            elif m.pongs == 0 and now - m.last_ping >= _MEASURE_RETRY_S:
                self._ping(m, now)
        stale = [k for k, v in self.incoming.items() if now - v.first > self.cfg.probe_timeout_s]
        for k in stale:
            del self.incoming[k]

    @property
    def busy(self) -> bool:
        """Whether a measurement is in progress (the loop then ticks often)."""
        return bool(self.measurements)

    def _start_bulk(self, m: Measurement, now: float) -> None:
        chunk = self.cfg.bandwidth_probe_chunk_bytes
        count = max(1, math.ceil(self.cfg.bandwidth_probe_bytes / chunk))
        m.probe_id = f"{self.ctx.node_id}-{m.seq}"
        m.bulk_started = time.monotonic()
        m.bulk_bytes = count * chunk
        for i in range(count):
            ok = self.ctx.out.send(
                m.cmd.peer,
                BulkData(
                    sender=self.ctx.node_id,
                    epoch=self.ctx.facts.epoch,
                    probe_id=m.probe_id,
                    index=i,
                    count=count,
                    size=chunk,
                ),
                self._chunk,  # the same immutable bytes every time: sent without a copy
            )
            if not ok:
                log.debug("bulk probe to %s: chunk %d not sent", m.cmd.peer, i)
                break

    def on_bulk_data(self, msg: BulkData, now: float) -> BulkAck | None:
        """Counts a bulk chunk; answers the last one."""
        inc = self.incoming.get(msg.probe_id)
        if inc is None:
            if len(self.incoming) >= 64:
                return None  # bounded: never let probes eat memory
            inc = self.incoming[msg.probe_id] = _Incoming(first=now)
        inc.received += msg.size  # validate() checked the attachment against it
        if msg.index + 1 < msg.count:
            return None
        del self.incoming[msg.probe_id]
        return BulkAck(
            sender=self.ctx.node_id,
            epoch=self.ctx.facts.epoch,
            probe_id=msg.probe_id,
            received_bytes=inc.received,
        )

    def on_bulk_ack(self, msg: BulkAck, now: float) -> None:
        """Completes a bandwidth measurement."""
        for m in self.measurements.values():
            if m.probe_id == msg.probe_id and msg.sender == m.cmd.peer:
                elapsed = max(1e-6, time.monotonic() - m.bulk_started - (m.rtt_s or 0.0) / 2)
                bw = msg.received_bytes * 8 / elapsed if msg.received_bytes > 0 else None
                self._finish(m, now, up=True, bandwidth_bps=bw)
                return

    def _finish(
        self, m: Measurement, now: float, up: bool, bandwidth_bps: float | None = None
    ) -> None:
        self.measurements.pop(m.seq, None)
        latency = m.rtt_s / 2 if m.rtt_s is not None else None
        if up and m.cmd.peer in self.links:
            self.links[m.cmd.peer].last_pong = now
        if up and m.pinged and latency is not None:
            for peer in [p for p, (_, t) in self.latencies.items() if now - t > _LATENCY_REUSE_S]:
                del self.latencies[peer]  # bounded: only recent ones are ever reused
            self.latencies[m.cmd.peer] = (latency, now)
        if up and bandwidth_bps is not None:
            self.measured[m.cmd.peer] = (latency, bandwidth_bps)
        self.ctx.event(
            "link_measured",
            peer=m.cmd.peer,
            up=up,
            latency_s=latency,
            bandwidth_bps=bandwidth_bps,
            op_id=m.cmd.op_id,
            pinged=m.pinged,
        )
        self.ctx.out.to_scheduler(
            LinkReport(
                sender=self.ctx.node_id,
                epoch=self.ctx.facts.epoch,
                term=self.ctx.facts.term,
                peer=m.cmd.peer,
                up=up,
                latency_s=latency,
                bandwidth_bps=bandwidth_bps,
                op_id=m.cmd.op_id,
            )
        )
