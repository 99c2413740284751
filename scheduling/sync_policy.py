"""The model synchronization policy: a reduction structure over overlay links (docs/daemon.md).

Pure: no I/O. Two candidates are built from the overlay graph and its measured link bandwidths:

* a **maximum-bottleneck spanning tree** (a maximum spanning tree by bandwidth maximizes the
  smallest link bandwidth it uses), rooted at its centre, for a pipelined reduce then broadcast;
  it works on any connected overlay;
* a **ring**, when a bounded search finds a Hamiltonian cycle of the overlay (only tried for at
  most ``max_ring_nodes`` nodes and ``ring_search_budget`` search steps).

The faster by a simple time estimate is returned:

* tree, pipelined in chunks of ``c`` bytes, reduce then broadcast over depth ``d``:
  ``2 * (M / B_min + d * (lat_max + c / B_min))``;
* ring allreduce over ``n`` nodes: ``2 * (n - 1) * (M / n / B_min + lat_max)``.

``B_min`` is the bottleneck bandwidth (bytes per second) of the structure and ``lat_max`` its
slowest link latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx


@dataclass(frozen=True)
class LinkEstimate:
    """One overlay link as the monitor knows it.

    Args:
        a: One end.
        b: The other end.
        bandwidth_bps: Measured bandwidth in bits per second (``None``: not measured yet).
        latency_s: Measured one-way latency in seconds (``None``: not measured yet).

    Raises:
        ValueError: a self-loop, or a non-positive bandwidth or negative latency.
    """

    a: str
    b: str
    bandwidth_bps: float | None = None
    latency_s: float | None = None

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"self-loop link on {self.a!r}")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"link {self.a}-{self.b}: bandwidth must be > 0")
        if self.latency_s is not None and not self.latency_s >= 0:
            raise ValueError(f"link {self.a}-{self.b}: latency must be >= 0")


@dataclass(frozen=True)
class SyncPolicy:
    """A reduction structure.

    Attributes:
        kind: ``"tree"``, ``"ring"`` or ``"single"`` (one node, nothing to reduce).
        nodes: The nodes it covers, sorted.
        root: The tree's root (``None`` for a ring).
        parents: ``(node, parent)`` pairs of the tree, sorted (the root's parent is ``None``).
            For a disconnected overlay this is a forest and each component root has ``None``.
        ring: The ring order (empty for a tree).
        bottleneck_bps: The structure's smallest link bandwidth, in bits per second.
        est_time_s: Estimated allreduce time of ``message_bytes``, in seconds.
        tree_time_s: The tree's estimate (``inf`` if none).
        ring_time_s: The ring's estimate (``inf`` if no ring was found).
        connected: Whether the overlay is connected (if not, training cannot reduce globally).
    """

    kind: str
    nodes: tuple[str, ...]
    root: str | None
    parents: tuple[tuple[str, str | None], ...]
    ring: tuple[str, ...]
    bottleneck_bps: float
    est_time_s: float
    tree_time_s: float
    ring_time_s: float
    connected: bool


def build_sync_policy(
    nodes: Sequence[str],
    links: Sequence[LinkEstimate],
    *,
    message_bytes: float = 100e6,
    default_bandwidth_bps: float = 100e6,
    default_latency_s: float = 1e-3,
    chunk_bytes: float = 1 << 20,
    max_ring_nodes: int = 16,
    ring_search_budget: int = 20_000,
) -> SyncPolicy:
    """Builds the sync policy over the overlay.

    Args:
        nodes: The members (unique ids).
        links: The overlay links that are up; links to unknown nodes are ignored.
        message_bytes: Gradient size used by the time estimates.
        default_bandwidth_bps: Bandwidth assumed for a link not measured yet.
        default_latency_s: Latency assumed for a link not measured yet.
        chunk_bytes: Pipeline chunk of the tree.
        max_ring_nodes: Do not search rings above this many nodes.
        ring_search_budget: Upper bound on the ring search's steps (keeps it cheap).

    Returns:
        The policy.

    Raises:
        ValueError: no nodes, duplicate nodes, or a non-positive size or bandwidth.
    """
    _check_inputs(nodes, message_bytes, default_bandwidth_bps, chunk_bytes)
    g = _graph(nodes, links, default_bandwidth_bps, default_latency_s)
    ordered = tuple(sorted(nodes))
    if len(ordered) == 1:
        return SyncPolicy(
            "single", ordered, ordered[0], ((ordered[0], None),), (), 0.0, 0.0, 0.0, 0.0, True
        )
    connected = nx.is_connected(g)
    root, parents, tree_bw, tree_lat, depth = _tree(g)
    tree_t = _tree_time(message_bytes, chunk_bytes, tree_bw, tree_lat, depth)
    if not connected:
        tree_t = math.inf
    ring = _ring(g, max_ring_nodes, ring_search_budget) if connected else None
    ring_t = math.inf
    ring_bw = 0.0
    if ring is not None:
        ring_bw, ring_t = _ring_estimate(g, ring, message_bytes)
    if ring is not None and ring_t < tree_t:
        return SyncPolicy(
            "ring", ordered, None, (), tuple(ring), ring_bw, ring_t, tree_t, ring_t, connected
        )
    return SyncPolicy(
        "tree", ordered, root, parents, (), tree_bw, tree_t, tree_t, ring_t, connected
    )


def _check_inputs(
    nodes: Sequence[str], message_bytes: float, default_bandwidth_bps: float, chunk_bytes: float
) -> None:
    """Validates :func:`build_sync_policy`'s arguments.

    Args:
        nodes: The members.
        message_bytes: Gradient size used by the time estimates.
        default_bandwidth_bps: Bandwidth assumed for a link not measured yet.
        chunk_bytes: Pipeline chunk of the tree.

    Raises:
        ValueError: no nodes, duplicate nodes, or a non-positive size or bandwidth.
    """
    if not nodes:
        raise ValueError("a sync policy needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise ValueError("duplicate node ids")
    for name, v in (
        ("message_bytes", message_bytes),
        ("default_bandwidth_bps", default_bandwidth_bps),
        ("chunk_bytes", chunk_bytes),
    ):
        if not v > 0:
            raise ValueError(f"{name} must be > 0")


def _tree_time(
    message_bytes: float, chunk_bytes: float, bw: float, lat: float, depth: int
) -> float:
    """Estimated time of a pipelined tree reduce then broadcast.

    Args:
        message_bytes: Gradient size, bytes.
        chunk_bytes: Pipeline chunk, bytes.
        bw: The tree's bottleneck bandwidth, bits per second.
        lat: The tree's slowest link latency, seconds.
        depth: The tree's depth.

    Returns:
        ``2 * (M / B_min + d * (lat_max + c / B_min))`` in seconds (sizes counted in bits).
    """
    return 2 * (message_bytes * 8 / bw + depth * (lat + chunk_bytes * 8 / bw))


def _ring_time(n: int, message_bytes: float, bw: float, lat: float) -> float:
    """Estimated time of a ring allreduce.

    Args:
        n: Nodes on the ring.
        message_bytes: Gradient size, bytes.
        bw: The ring's bottleneck bandwidth, bits per second.
        lat: The ring's slowest link latency, seconds.

    Returns:
        ``2 * (n - 1) * (M / n / B_min + lat_max)`` in seconds (sizes counted in bits).
    """
    return 2 * (n - 1) * (message_bytes * 8 / n / bw + lat)


def _ring_edges(ring: Sequence[str]) -> list[tuple[str, str]]:
    """The links of a ring, each node to its successor (the last to the first).

    Args:
        ring: The ring order.

    Returns:
        The ``(node, successor)`` pairs, in ring order.
    """
    order = list(ring)
    return list(zip(order, order[1:] + order[:1], strict=True))


def _ring_estimate(g: nx.Graph, ring: list[str], message_bytes: float) -> tuple[float, float]:
    """The bottleneck and estimated allreduce time of a ring of ``g``.

    Args:
        g: The overlay graph (edges with ``bw`` and ``lat``).
        ring: The ring order; every consecutive pair is an edge of ``g``.
        message_bytes: Gradient size, bytes.

    Returns:
        ``(bottleneck_bps, est_time_s)``.
    """
    edges = _ring_edges(ring)
    ring_bw = min(g.edges[e]["bw"] for e in edges)
    ring_lat = max(g.edges[e]["lat"] for e in edges)
    return ring_bw, _ring_time(len(ring), message_bytes, ring_bw, ring_lat)


def _graph(
    nodes: Sequence[str], links: Sequence[LinkEstimate], bw0: float, lat0: float
) -> nx.Graph:
    g = nx.Graph()
    g.add_nodes_from(nodes)
    for link in links:
        if link.a not in g or link.b not in g:
            continue
        bw = link.bandwidth_bps if link.bandwidth_bps is not None else bw0
        lat = link.latency_s if link.latency_s is not None else lat0
        if g.has_edge(link.a, link.b):  # keep the better measurement of a duplicate
            bw = max(bw, g.edges[link.a, link.b]["bw"])
        g.add_edge(link.a, link.b, bw=bw, lat=lat)
    return g


def _tree(g: nx.Graph) -> tuple[str, tuple[tuple[str, str | None], ...], float, float, int]:
    """Maximum spanning forest by bandwidth, each component rooted at its centre."""
    t = nx.maximum_spanning_tree(g, weight="bw")
    parents: dict[str, str | None] = {}
    root_of_largest: str | None = None
    depth = 0
    largest = -1
    for comp in sorted(nx.connected_components(t), key=lambda c: sorted(c)):
        sub = t.subgraph(comp)
        root = min(nx.center(sub))  # deterministic choice among centres
        lengths = nx.single_source_shortest_path_length(sub, root)
        parents[root] = None
        for child, parent in nx.bfs_predecessors(sub, root):
            parents[child] = parent
        if len(comp) > largest:
            largest, root_of_largest = len(comp), root
            depth = max(lengths.values())
    bws = [d["bw"] for _, _, d in t.edges(data=True)]
    lats = [d["lat"] for _, _, d in t.edges(data=True)]
    bw = min(bws) if bws else math.inf
    lat = max(lats) if lats else 0.0
    return root_of_largest or "", tuple(sorted(parents.items())), bw, lat, depth


def _ring(g: nx.Graph, max_nodes: int, budget: int) -> list[str] | None:
    """Bounded DFS for a Hamiltonian cycle, widest links first; keeps the best bottleneck."""
    n = g.number_of_nodes()
    if n < 2 or n > max_nodes:
        return None
    if n == 2:
        return sorted(g.nodes) if g.number_of_edges() == 1 else None
    if any(d < 2 for _, d in g.degree()):
        return None
    start = min(g.nodes)
    best: list[str] | None = None
    best_bw = 0.0
    steps = 0
    path = [start]
    seen = {start}

    def nbrs(u: str) -> list[str]:
        return sorted(g.neighbors(u), key=lambda v: (-g.edges[u, v]["bw"], v))

    stack: list[tuple[float, list[str]]] = [(math.inf, nbrs(start))]
    while stack and steps < budget:
        bottleneck, cands = stack[-1]
        if not cands:
            stack.pop()
            seen.discard(path.pop())
            continue
        v = cands.pop(0)
        steps += 1
        if v in seen:
            continue
        u = path[-1]
        bw = min(bottleneck, g.edges[u, v]["bw"])
        if bw <= best_bw:
            continue  # cannot beat the best ring found
        path.append(v)
        seen.add(v)
        if len(path) == n:
            if g.has_edge(v, start):
                close = min(bw, g.edges[v, start]["bw"])
                if close > best_bw:
                    best, best_bw = list(path), close
            seen.discard(path.pop())
            continue
        stack.append((bw, nbrs(v)))
    return best


def retain_structure(
    previous: SyncPolicy,
    candidate: SyncPolicy,
    links: Sequence[LinkEstimate],
    *,
    min_gain: float,
    message_bytes: float = 100e6,
    default_bandwidth_bps: float = 100e6,
    default_latency_s: float = 1e-3,
    chunk_bytes: float = 1 << 20,
) -> SyncPolicy:
    """Keeps the structure in force unless ``candidate`` is clearly faster (hysteresis).

    Changing the reduction structure re-wires every trainer's sockets and can make members that
    switch at different step boundaries rerun a round; link measurements are noisy (on a busy
    host, loopback "links" vary by 2x). So ``previous`` is kept, re-estimated under ``links``,
    while it still applies (same nodes, both connected, every edge still up) and ``candidate`` is
    not faster by more than ``min_gain`` of its time.

    Args:
        previous: The structure in force.
        candidate: What :func:`build_sync_policy` builds now.
        links: The overlay links that are up, as for :func:`build_sync_policy`.
        min_gain: Fraction of ``previous``'s estimated time that ``candidate`` must save
            (``0``: switch on any improvement).
        message_bytes: As for :func:`build_sync_policy`.
        default_bandwidth_bps: As for :func:`build_sync_policy`.
        default_latency_s: As for :func:`build_sync_policy`.
        chunk_bytes: As for :func:`build_sync_policy`.

    Returns:
        ``previous`` re-estimated, or ``candidate``.

    Raises:
        ValueError: ``min_gain`` outside ``[0, 1)``.
    """
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    if (
        previous.kind not in ("tree", "ring")
        or previous.kind != candidate.kind
        or previous.nodes != candidate.nodes
        or not candidate.connected
        or not previous.connected  # a forest of a split overlay is never kept once it heals
    ):
        return candidate
    g = _graph(candidate.nodes, links, default_bandwidth_bps, default_latency_s)
    estimate = _reestimate(previous, g, message_bytes, chunk_bytes)
    if estimate is None:
        return candidate
    bw, t = estimate
    if candidate.est_time_s < t * (1.0 - min_gain):
        return candidate
    tree_t = t if previous.kind == "tree" else candidate.tree_time_s
    ring_t = t if previous.kind == "ring" else candidate.ring_time_s
    return SyncPolicy(
        previous.kind, previous.nodes, previous.root, previous.parents, previous.ring, bw, t,
        tree_t, ring_t, True,
    )  # fmt: skip


def _reestimate(
    previous: SyncPolicy, g: nx.Graph, message_bytes: float, chunk_bytes: float
) -> tuple[float, float] | None:
    """Re-estimates a tree or ring structure over the overlay as it is now.

    Args:
        previous: The structure in force (``kind`` is ``"tree"`` or ``"ring"``).
        g: The overlay graph (edges with ``bw`` and ``lat``), as :func:`_graph` builds it.
        message_bytes: Gradient size, bytes.
        chunk_bytes: Pipeline chunk of a tree, bytes.

    Returns:
        ``(bottleneck_bps, est_time_s)``, or ``None`` when the structure has no edge or one of
        its edges is no longer up.
    """
    if previous.kind == "ring":
        edges = _ring_edges(previous.ring)
    else:
        edges = [(c, p) for c, p in previous.parents if p is not None]
    if not edges or not all(g.has_edge(a, b) for a, b in edges):
        return None
    bw = min(g.edges[e]["bw"] for e in edges)
    lat = max(g.edges[e]["lat"] for e in edges)
    if previous.kind == "ring":
        t = _ring_time(len(previous.ring), message_bytes, bw, lat)
    else:
        t = _tree_time(message_bytes, chunk_bytes, bw, lat, _depth(previous.parents))
    return bw, t


def _depth(parents: tuple[tuple[str, str | None], ...]) -> int:
    """Depth of a tree given as ``(node, parent)`` pairs (the root's parent is ``None``)."""
    up = dict(parents)
    depth = 0
    for node in up:
        d, cur, seen = 0, node, set()
        while up.get(cur) is not None and cur not in seen:
            seen.add(cur)
            cur = up[cur]  # type: ignore[assignment]
            d += 1
        depth = max(depth, d)
    return depth
