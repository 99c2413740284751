"""The answers to the local clients' read-only requests: ``status`` and the trainer's policy.

They read the daemon through :class:`ReplySource`, the few things they show.
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec
from chaos.daemon.config import DaemonConfig
from chaos.daemon.election import Election
from chaos.daemon.facts import MemberFacts
from chaos.daemon.scheduler.activity import join_activity, member_activity
from chaos.daemon.scheduler.monitor import ClusterMonitor

from chaos.protocol import (
    ClusterUpdate,
    ClusterView,
    EventEntry,
    LinkInfo,
    PolicyNotice,
    PolicyReply,
    StatusReply,
    encode,
)
from chaos.protocol.messages import AuditInfo
from chaos.protocol.states import TrainerPhase

NOTICE_POLICY_MAX_BYTES = 64 << 10
"""Largest policy a notice carries; a trainer asks for a bigger one."""


class ReplySource(MemberFacts, Protocol):
    """What the answers show of the daemon."""

    cfg: DaemonConfig
    election: Election

    @property
    def view(self) -> ClusterView | None: ...  # noqa: D102

    @property
    def update(self) -> ClusterUpdate | None: ...  # noqa: D102

    @property
    def is_scheduler(self) -> bool: ...  # noqa: D102

    @property
    def scheduler_monitor(self) -> ClusterMonitor | None:
        """The scheduler role's monitor (``None``: this node is not the scheduler)."""

    @property
    def measured(self) -> dict[str, tuple[float | None, float | None]]:
        """This node's latest measurement of each of its links, by peer."""

    @property
    def notify_endpoint(self) -> str | None:
        """Where the daemon publishes its policy notices."""

    def members(self) -> list[str]: ...  # noqa: D102

    def status_notes(self) -> list[str]:
        """Lines worth a look in ``status`` (e.g. a trainer that exited)."""

    def recent_events(self) -> list[EventEntry]:
        """This daemon's most recent events, oldest first."""

    @property
    def trainer_audit(self) -> AuditInfo | None:
        """The local trainer's last reported state audit."""

    @property
    def trainer_phase(self) -> TrainerPhase | None:
        """The local trainer's last reported lifecycle phase."""


def status_reply(d: ReplySource) -> StatusReply:
    """The daemon's state and its copy of the cluster view.

    The scheduler shows the trainer states and links its monitor holds now: ``ready`` and a link
    measurement that leaves the sync policy as it was change them without a new epoch. A member
    shows its view, with its own links' latest measurements laid over it.
    """
    view = d.view
    nodes = list(view.nodes) if view else []
    links = list(view.links) if view else []
    monitor = d.scheduler_monitor
    now = time.monotonic()
    if monitor is not None:
        nodes = monitor.with_trainer_states(nodes)
        links = list(monitor.to_view(d.epoch, d.term, d.node_id).links)
    else:
        links = _with_own_measurements(d.node_id, links, d.measured)
    return StatusReply(
        sender=d.node_id,
        epoch=d.epoch,
        node_id=d.node_id,
        role=d.election.role.value,
        state=d.state.value,
        paused=d.paused,
        scheduler=d.node_id if d.is_scheduler else d.election.scheduler,
        term=d.term,
        nodes=nodes,
        links=links,
        sync=d.update.sync if d.update else None,
        notes=[n[:256] for n in d.status_notes()[:32]],
        audit=d.trainer_audit,
        activity=member_activity(monitor, now) if monitor is not None else [],
        joins=join_activity(monitor, now) if monitor is not None else [],
        events=d.recent_events(),
        trainer_phase=d.trainer_phase,
    )


def _with_own_measurements(
    me: str, links: list[LinkInfo], measured: dict[str, tuple[float | None, float | None]]
) -> list[LinkInfo]:
    """``links`` with this node's own latest measurement of each of its links."""
    out = []
    for x in links:
        peer = x.b if x.a == me else x.a if x.b == me else None
        got = measured.get(peer) if peer is not None else None
        if got is not None and x.up:
            lat, bw = got
            x = msgspec.structs.replace(
                x, latency_s=lat if lat is not None else x.latency_s, bandwidth_bps=bw
            )
        out.append(x)
    return out


def policy_reply(d: ReplySource) -> PolicyReply:
    """The policies of the installed epoch, for the trainer (``epoch``: that epoch)."""
    u = d.update
    return PolicyReply(
        sender=d.node_id,
        epoch=d.epoch,
        term=d.term,
        members=d.members(),
        sync=u.sync if u else None,
        replication=u.replication if u else None,
        apply_at=u.apply_at if u else "after_allreduce",
        restart_allreduce=u.restart_allreduce if u else False,
        paused=d.paused,
        notify_address=d.notify_endpoint,
        notify_interval_s=d.cfg.heartbeat_interval_s,
    )


def policy_notice(d: ReplySource, with_policy: bool) -> PolicyNotice:
    """What the daemon publishes to its trainers: the installed epoch and the pause state, and,
    with ``with_policy``, the policy itself when it encodes to at most
    ``NOTICE_POLICY_MAX_BYTES`` (a large replication plan is fetched instead)."""
    policy = None
    if with_policy:
        reply = policy_reply(d)
        if len(encode(reply)) <= NOTICE_POLICY_MAX_BYTES:
            policy = reply
    return PolicyNotice(
        sender=d.node_id,
        epoch=d.epoch,
        paused=d.paused,
        interval_s=d.cfg.heartbeat_interval_s,
        policy=policy,
    )
