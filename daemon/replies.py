"""The answers to the local clients' read-only requests: ``status`` and the trainer's policy.

They read the daemon's :class:`~chaos.daemon.context.NodeFacts`, this node's own link
measurements and its trainer's relay.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from chaos.daemon.scheduler.activity import join_activity, member_activity
from chaos.daemon.scheduler.role import DaemonContext, DaemonFacts

from chaos.protocol import (
    LinkInfo,
    PolicyNotice,
    PolicyReply,
    StatusReply,
    encode,
)

if TYPE_CHECKING:
    from chaos.daemon.relay import TrainerRelay

Measured = dict[str, tuple[float | None, float | None]]
"""This node's latest measurement of each of its links: peer -> (latency_s, bandwidth_bps)."""

NOTICE_POLICY_MAX_BYTES = 64 << 10
"""Largest policy a notice carries; a trainer asks for a bigger one."""


def status_reply(ctx: DaemonContext, measured: Measured, trainer: TrainerRelay) -> StatusReply:
    """The daemon's state and its copy of the cluster view.

    The scheduler shows the trainer states and links its monitor holds now: ``ready`` and a link
    measurement that leaves the sync policy as it was change them without a new epoch. A member
    shows its view, with its own links' latest measurements (``measured``) laid over it.
    ``trainer`` is the local trainer's relay: its audit, phase and notes.
    """
    d = ctx.facts
    view = d.view
    nodes = list(view.nodes) if view else []
    links = list(view.links) if view else []
    monitor = d.scheduler_monitor
    now = time.monotonic()
    if monitor is not None:
        nodes = monitor.with_trainer_states(nodes)
        links = list(monitor.to_view(d.epoch, d.term, d.node_id).links)
    else:
        links = _with_own_measurements(d.node_id, links, measured)
    notes = trainer.notes() + (d.role.trainers.notes() if d.role is not None else [])
    return StatusReply(
        sender=d.node_id,
        epoch=d.epoch,
        node_id=d.node_id,
        role=d.election.role.value,
        state=d.state.value,
        paused=d.paused,
        scheduler=d.scheduler,
        term=d.term,
        nodes=nodes,
        links=links,
        sync=d.update.sync if d.update else None,
        notes=[n[:256] for n in notes[:32]],
        audit=trainer.audit,
        activity=member_activity(monitor, now) if monitor is not None else [],
        joins=join_activity(monitor, now) if monitor is not None else [],
        events=ctx.events.recent(),
        trainer_phase=trainer.phase,
    )


def _with_own_measurements(
    me: str, links: list[LinkInfo], measured: Measured
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


def policy_reply(d: DaemonFacts, notify_endpoint: str | None) -> PolicyReply:
    """The policies of the installed epoch, for the trainer (``epoch``: that epoch), with where
    the daemon publishes its notices."""
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
        notify_address=notify_endpoint,
        notify_interval_s=d.cfg.heartbeat_interval_s,
    )


def policy_notice(d: DaemonFacts, notify_endpoint: str | None, with_policy: bool) -> PolicyNotice:
    """What the daemon publishes to its trainers: the installed epoch and the pause state, and,
    with ``with_policy``, the policy itself when it encodes to at most
    ``NOTICE_POLICY_MAX_BYTES`` (a large replication plan is fetched instead)."""
    policy = None
    if with_policy:
        reply = policy_reply(d, notify_endpoint)
        if len(encode(reply)) <= NOTICE_POLICY_MAX_BYTES:
            policy = reply
    return PolicyNotice(
        sender=d.node_id,
        epoch=d.epoch,
        paused=d.paused,
        interval_s=d.cfg.heartbeat_interval_s,
        policy=policy,
    )
