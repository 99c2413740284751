"""The answers to the local clients' read-only requests: ``status`` and the trainer's policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chaos.protocol import PolicyReply, StatusReply

if TYPE_CHECKING:
    from chaos.daemon.node import Daemon


def status_reply(d: Daemon) -> StatusReply:
    """The daemon's state and its copy of the cluster view.

    The scheduler shows the trainer states it holds now: ``ready`` changes a node to
    ``training`` without a new epoch, so the members show it only from the next view.
    """
    view = d.view
    nodes = list(view.nodes) if view else []
    if d.negotiator is not None:
        nodes = d.negotiator.monitor.with_trainer_states(nodes)
    return StatusReply(
        sender=d.node_id,
        epoch=d.epoch,
        node_id=d.node_id,
        role=d.election.role.value,
        state=d.state.value,
        paused=d.paused,
        scheduler=d.node_id if d.is_scheduler else d.election.leader,
        term=d.term,
        nodes=nodes,
        links=list(view.links) if view else [],
        sync=d.update.sync if d.update else None,
    )


def policy_reply(d: Daemon) -> PolicyReply:
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
    )
