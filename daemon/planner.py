"""The plan generator: the sync policy and the state replication policy, from monitor data.

Both are computed in :mod:`chaos.scheduling` (pure); this module only converts the monitor's
measurements into their inputs and their results into wire structs.
"""

from __future__ import annotations

import logging

from chaos.daemon.config import DaemonConfig
from chaos.daemon.monitor import ClusterMonitor
from chaos.scheduling.sync_policy import SyncPolicy, build_sync_policy

from chaos.protocol import ReplicationWire, SyncPolicyWire

log = logging.getLogger("chaos.daemon.planner")


def sync_policy(monitor: ClusterMonitor, cfg: DaemonConfig) -> SyncPolicy:
    """Builds the sync policy over the active members and the links that are up.

    Args:
        monitor: The cluster monitor.
        cfg: Gives the assumed bandwidth of unmeasured links and the gradient size.

    Returns:
        The policy (a ``"single"`` policy when at most one member is active).
    """
    members = monitor.members()
    if not members:  # the last node left
        return SyncPolicy("single", (), None, (), (), 0.0, 0.0, 0.0, 0.0, True)
    return build_sync_policy(
        members,
        monitor.up_links(members),
        message_bytes=float(cfg.sync_message_bytes),
        default_bandwidth_bps=cfg.default_bandwidth_bps,
    )


def to_wire(p: SyncPolicy) -> SyncPolicyWire:
    """Converts a :class:`SyncPolicy` to its wire struct."""
    kind = p.kind if p.kind in ("tree", "ring", "single") else "tree"
    return SyncPolicyWire(
        kind=kind,  # type: ignore[arg-type]
        nodes=list(p.nodes),
        root=p.root,
        parents=dict(p.parents),
        ring=list(p.ring),
        bottleneck_bps=p.bottleneck_bps if p.bottleneck_bps != float("inf") else 0.0,
        est_time_s=p.est_time_s if p.est_time_s != float("inf") else 0.0,
        connected=p.connected,
    )


def replication_policy(
    joiner: str,
    links: dict[str, tuple[float | None, float | None]],
    state_bytes: int | None,
    tensor_sizes: list[int] | None,
    cfg: DaemonConfig,
) -> ReplicationWire:
    """Runs Algorithm 1 + 2 (``chaos.scheduling.plan_replication``) for a joiner.

    Args:
        joiner: The joining node.
        links: Neighbour id -> (latency_s, bandwidth_bps) of its link to the joiner.
        state_bytes: Total state size, if the joiner reported one.
        tensor_sizes: Tensor sizes in canonical order, if reported (preferred).
        cfg: Per-shard cost and the bandwidth assumed for unmeasured links.

    Returns:
        The replication policy, or one with ``skipped`` set when the state size is unknown (the
        trainer reports it in a later issue) or planning failed.
    """
    sizes = tensor_sizes if tensor_sizes else ([state_bytes] if state_bytes else None)
    if not sizes or sum(sizes) <= 0:
        return ReplicationWire(target=joiner, skipped="state size unknown")
    if not links:
        return ReplicationWire(target=joiner, skipped="no neighbours")
    from chaos.scheduling import Neighbor, plan_replication

    neighbors = [
        Neighbor.from_bandwidth(
            nid,
            bw if bw is not None else cfg.default_bandwidth_bps,
            lat if lat is not None else 0.0,
        )
        for nid, (lat, bw) in sorted(links.items())
    ]
    try:
        plan = plan_replication(
            tensor_sizes=sizes,
            neighbors=neighbors,
            per_shard_cost_s=cfg.per_shard_cost_s,
            layout="flat",
            method="chaos",
        )
    except (ValueError, ArithmeticError) as exc:
        log.warning("replication planning failed: %s", exc)
        return ReplicationWire(target=joiner, skipped=f"planning failed: {exc}"[:200])
    return ReplicationWire(
        target=joiner,
        shard_size=plan.shard_size,
        assignment={k: [(int(o), int(n)) for o, n in v] for k, v in plan.assignment.items()},
        makespan_s=plan.makespan_s,
    )
