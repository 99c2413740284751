"""Healing a split overlay: which pairs of live members to connect across a cut.

Pure logic over the cluster monitor's graph (no sockets). When a failure, a leave or a link
loss splits the overlay of active members into parts, the scheduler reconnects the parts with
connect-link (the paper's own primitive), trying the best candidate pair first; a pair that
cannot reach each other (the network itself is partitioned there) is skipped and the next one
is tried.

The rank of a candidate pair ``(u, v)``: the estimated bandwidth of the new link, taken as the
smaller of the two ends' best measured link bandwidth (a device on a fast access link is likely
fast to reach); then the lower measured latency; then the fewer links the two ends already
have (spread the load); then the ids, so the order is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

__all__ = ["candidate_pairs", "components"]


def components(graph: nx.Graph, members: Iterable[str]) -> list[list[str]]:
    """The parts of the overlay of ``members`` over its up links, largest first.

    Args:
        graph: The monitor's graph (link attribute ``up``).
        members: The live members.

    Returns:
        Each part's sorted member ids (one part: the overlay is connected).
    """
    keep = [m for m in members if m in graph]
    h = nx.Graph()
    h.add_nodes_from(keep)
    h.add_edges_from(
        (a, b) for a, b, d in graph.edges(data=True) if d.get("up", True) and a in h and b in h
    )
    parts = [sorted(c) for c in nx.connected_components(h)]
    return sorted(parts, key=lambda c: (-len(c), c[0]))


def _access(graph: nx.Graph, node: str, default_bps: float) -> tuple[float, float, int]:
    """(best measured bandwidth, best measured latency, number of up links) of ``node``."""
    bws: list[float] = []
    lats: list[float] = []
    degree = 0
    for _, _, d in graph.edges(node, data=True):
        if not d.get("up", True):
            continue
        degree += 1
        if d.get("bandwidth_bps"):
            bws.append(float(d["bandwidth_bps"]))
        if d.get("latency_s") is not None:
            lats.append(float(d["latency_s"]))
    return (max(bws) if bws else default_bps, min(lats) if lats else float("inf"), degree)


def candidate_pairs(
    graph: nx.Graph,
    members: Iterable[str],
    default_bps: float,
    exclude: Iterable[frozenset[str]] = (),
) -> list[tuple[str, str]]:
    """The pairs that would join the largest part to another part, best first.

    Args:
        graph: The monitor's graph.
        members: The live members.
        default_bps: Bandwidth assumed for a node without a measured link.
        exclude: Pairs already tried (unreachable) that are not proposed again.

    Returns:
        ``(a, b)`` pairs, ``a`` in the largest part and ``b`` in another; empty when the
        overlay is connected or every pair was tried.
    """
    parts = components(graph, members)
    if len(parts) < 2:
        return []
    tried = set(exclude)
    access = {n: _access(graph, n, default_bps) for part in parts for n in part}
    main, others = parts[0], [n for part in parts[1:] for n in part]
    ranked: list[tuple[tuple[float, float, int, str, str], tuple[str, str]]] = []
    for a in main:
        for b in others:
            if frozenset((a, b)) in tried:
                continue
            (bw_a, lat_a, deg_a), (bw_b, lat_b, deg_b) = access[a], access[b]
            key = (-min(bw_a, bw_b), lat_a + lat_b, deg_a + deg_b, a, b)
            ranked.append((key, (a, b)))
    ranked.sort()
    return [pair for _, pair in ranked]
