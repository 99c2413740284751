"""The plan generator: the sync policy and the state replication policy, from monitor data.

Both are computed in :mod:`chaos.scheduling` (pure); this module only converts the monitor's
measurements into their inputs and their results into wire structs.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from chaos.daemon.config import DaemonConfig
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.scheduling.plan import PlanMethod
from chaos.scheduling.sync_policy import SyncPolicy, build_sync_policy, retain_structure

from chaos.protocol import DonorLink, ReplicationWire, SyncPolicyWire

if TYPE_CHECKING:
    from chaos.scheduling import Neighbor, Plan

MAX_PLAN_SHARDS = 16_384
"""A plan with more shards is re-planned at a larger fixed shard size (bounds the update's size)."""

log = logging.getLogger("chaos.daemon.scheduler.planner")

_METHODS = {"chaos": PlanMethod.CHAOS, "even": PlanMethod.EVEN,
            "single-source": PlanMethod.SINGLE_SOURCE, "multi-source": PlanMethod.EVEN}  # fmt: skip
"""``plan_replication`` method of each replication strategy (multi-source differs from even
in its donors: every training member instead of the joiner's neighbours)."""


def sync_policy(
    monitor: ClusterMonitor, cfg: DaemonConfig, previous: SyncPolicyWire | None = None
) -> SyncPolicy:
    """Builds the sync policy over the active members with a trainer (``syncing`` or
    ``training``) and the links that are up between them (multi-hop through other nodes).

    Args:
        monitor: The cluster monitor.
        cfg: Gives the assumed bandwidth of unmeasured links, the gradient size and
            ``sync_switch_min_gain``.
        previous: The policy in force: its structure is kept while it still applies and the
            new one is not faster by ``cfg.sync_switch_min_gain``
            (:func:`chaos.scheduling.sync_policy.retain_structure`).

    Returns:
        The policy (a ``"single"`` policy when at most one member has a trainer, with no node
        when none has).
    """
    members = [m for m in monitor.trainer_members() if m not in monitor.catching_up]
    if not members:  # no trainer registered (yet), or the last one left
        return SyncPolicy("single", (), None, (), (), 0.0, 0.0, 0.0, 0.0, True)
    links = monitor.sync_links(members)
    msg = float(cfg.sync_message_bytes)
    candidate = build_sync_policy(
        members, links, message_bytes=msg, default_bandwidth_bps=cfg.default_bandwidth_bps
    )
    if previous is None or previous.kind == "single":
        return candidate
    return retain_structure(
        _from_wire(previous),
        candidate,
        links,
        min_gain=cfg.sync_switch_min_gain,
        message_bytes=msg,
        default_bandwidth_bps=cfg.default_bandwidth_bps,
    )


def _from_wire(w: SyncPolicyWire) -> SyncPolicy:
    return SyncPolicy(
        w.kind, tuple(sorted(w.nodes)), w.root, tuple(sorted(w.parents.items())), tuple(w.ring),
        w.bottleneck_bps, w.est_time_s, w.est_time_s, math.inf, w.connected,
    )  # fmt: skip


def same_data_plane(a: SyncPolicyWire | None, b: SyncPolicyWire) -> bool:
    """Whether two sync policies wire the data plane identically.

    Only the structure counts (kind, nodes, root, parents, ring order, data endpoints, the
    trainers' keys and connectivity); the estimates (``bottleneck_bps``, ``est_time_s``) do
    not, since no trainer acts on them.
    """
    if a is None:
        return False
    return (
        a.kind == b.kind
        and a.nodes == b.nodes
        and a.root == b.root
        and a.parents == b.parents
        and a.ring == b.ring
        and a.addresses == b.addresses
        and a.keys == b.keys
        and a.connected == b.connected
    )


def policy_edges(p: SyncPolicyWire | None) -> set[frozenset[str]]:
    """The node pairs a sync policy sends gradients between (tree edges, or ring neighbours)."""
    if p is None:
        return set()
    if p.kind == "ring" and len(p.ring) > 1:
        return {frozenset((x, p.ring[(i + 1) % len(p.ring)])) for i, x in enumerate(p.ring)}
    return {frozenset((c, up)) for c, up in p.parents.items() if up is not None}


def data_addresses(monitor: ClusterMonitor, nodes: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The data-plane endpoints of ``nodes`` (those that registered one)."""
    out: dict[str, str] = {}
    for n in nodes:
        a = monitor.node_attr(n, "data_address") if monitor.has(n) else None
        if a:
            out[n] = a
    return out


def data_keys(monitor: ClusterMonitor, nodes: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The CURVE public keys of the trainers of ``nodes`` (those that registered one)."""
    out: dict[str, str] = {}
    for n in nodes:
        k = monitor.node_attr(n, "data_key") if monitor.has(n) else ""
        if k:
            out[n] = k
    return out


def to_wire(
    p: SyncPolicy, addresses: dict[str, str] | None = None, keys: dict[str, str] | None = None
) -> SyncPolicyWire:
    """Converts a :class:`SyncPolicy` to its wire struct (with the nodes' data endpoints and
    their trainers' keys)."""
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
        addresses=dict(addresses or {}),
        keys=dict(keys or {}),
    )


def replication_policy(
    joiner: str,
    links: dict[str, tuple[float | None, float | None]],
    state_bytes: int | None,
    tensor_sizes: list[int] | None,
    cfg: DaemonConfig,
    addresses: dict[str, str] | None = None,
    sync_s: dict[str, float] | None = None,
    per_shard_cost_s: float | None = None,
) -> ReplicationWire:
    """Runs Algorithm 1 + 2 (``chaos.scheduling.plan_replication``) for a joiner.

    Args:
        joiner: The joining node.
        links: Donor id -> (latency_s, bandwidth_bps) of its link (or path) to the joiner;
            ``None`` values: not measured (``cfg.default_bandwidth_bps`` and 0 s are assumed).
        state_bytes: Total state size, if the joiner reported one.
        tensor_sizes: Tensor sizes in canonical order, if reported (preferred).
        cfg: The bandwidth assumed for unmeasured links, the prior per-shard cost, the strategy.
        addresses: Donor id -> shard-server endpoint (``donor_addresses`` of the result).
        sync_s: Donor id -> when it can start sending (tau_sync), in seconds; default 0.
        per_shard_cost_s: The per-shard cost c (the monitor's measured value); ``None``: the
            configured prior ``cfg.per_shard_cost_s``. The policy carries it, so that the
            joiner's re-plans use the same c.

    Returns:
        The replication policy, or one with ``skipped`` set when the state size is unknown (the
        joiner's trainer has not reported it yet) or planning failed.
    """
    sizes = tensor_sizes if tensor_sizes else ([state_bytes] if state_bytes else None)
    if not sizes or sum(sizes) <= 0:
        return ReplicationWire(target=joiner, skipped="state size unknown")
    if not links:
        return ReplicationWire(target=joiner, skipped="no neighbours")
    taus = sync_s or {}
    c = cfg.per_shard_cost_s if per_shard_cost_s is None else per_shard_cost_s
    try:
        neighbors = _neighbors(links, cfg, taus)
        plan = _plan(sizes, neighbors, cfg, c)
    except (ValueError, ArithmeticError) as exc:
        log.warning("replication planning failed: %s", exc)
        return ReplicationWire(target=joiner, skipped=f"planning failed: {exc}"[:200])
    return ReplicationWire(
        target=joiner,
        shard_size=plan.shard_size,
        assignment={k: [(int(o), int(n)) for o, n in v] for k, v in plan.assignment.items()},
        makespan_s=plan.makespan_s,
        donor_addresses={k: v for k, v in (addresses or {}).items() if k in links},
        donors=[
            DonorLink(
                id=n.id, prop_s=n.prop_s, trans_s_per_byte=n.trans_s_per_byte, sync_s=n.sync_s
            )
            for n in neighbors
        ],
        tensor_sizes=list(sizes) if tensor_sizes else [],
        method=_METHODS[cfg.replication_strategy],
        per_shard_cost_s=plan.per_shard_cost_s,
    )


def _neighbors(
    links: dict[str, tuple[float | None, float | None]],
    cfg: DaemonConfig,
    taus: dict[str, float],
) -> list[Neighbor]:
    """The joiner's donors as planner inputs, sorted by id.

    Args:
        links: Donor id -> (latency_s, bandwidth_bps); ``None``: not measured
            (``cfg.default_bandwidth_bps`` and 0 s are assumed).
        cfg: Gives the bandwidth assumed for unmeasured links.
        taus: Donor id -> when it can start sending, in seconds (default 0).

    Returns:
        One :class:`~chaos.scheduling.Neighbor` per donor.

    Raises:
        ValueError: a bandwidth, latency or start time the planner rejects.
    """
    from chaos.scheduling import Neighbor

    return [
        Neighbor.from_bandwidth(
            nid,
            bw if bw is not None else cfg.default_bandwidth_bps,
            lat if lat is not None else 0.0,
            taus.get(nid, 0.0),
        )
        for nid, (lat, bw) in sorted(links.items())
    ]


def _plan(sizes: list[int], neighbors: list[Neighbor], cfg: DaemonConfig, c: float) -> Plan:
    """Plans the replication, re-planning at a larger fixed shard size above
    :data:`MAX_PLAN_SHARDS` shards.

    Args:
        sizes: Tensor sizes in canonical order (or the one total state size).
        neighbors: The donors.
        cfg: The replication strategy.
        c: The per-shard cost, in seconds.

    Returns:
        The plan.

    Raises:
        ValueError: the planner rejects its inputs.
        ArithmeticError: the planner's arithmetic failed.
    """
    from chaos.scheduling import plan_replication

    def plan(shard_size: int | None = None) -> Plan:
        return plan_replication(
            tensor_sizes=sizes,
            neighbors=neighbors,
            per_shard_cost_s=c,
            layout="flat",
            method=_METHODS[cfg.replication_strategy],
            shard_size=shard_size,
        )

    first = plan()
    if first.num_shards <= MAX_PLAN_SHARDS:
        return first
    return plan(math.ceil(sum(sizes) / MAX_PLAN_SHARDS))
