"""The cluster monitor (paper IV-A): a networkx graph of nodes and overlay links.

Nodes carry ``address``, ``state`` (:class:`~chaos.protocol.states.NodeState`), ``joined_at``,
``resources`` and their trainer's registration (``trainer``
(:class:`~chaos.protocol.states.TrainerState`), ``data_address``, ``shard_address``,
``tensor_sizes``); a node's neighbours are its graph neighbours over links that are up. Links carry
``bandwidth_bps``, ``latency_s``, ``tau_sync_s`` (the donor's measured start delay in the last
replication plan over the link) and ``up``. The monitor holds no sockets; the
scheduler role edits it and turns it into a :class:`~chaos.protocol.ClusterView`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import networkx as nx
from chaos.scheduling.sync_policy import LinkEstimate

from chaos.errors import ChaosError
from chaos.protocol import ClusterView, LinkInfo, NodeInfo, PullStatus, Resources
from chaos.protocol.states import (
    NODE_TRANSITIONS,
    TRAINER_TRANSITIONS,
    NodeState,
    TrainerPhase,
    TrainerState,
)

PER_SHARD_COST_SMOOTHING = 0.3
"""Weight of a new pull's fit in the smoothed per-shard cost (the first fit replaces the prior)."""
MAX_PER_SHARD_COST_S = 0.1
"""A fitted per-shard cost is clipped to ``[0, MAX_PER_SHARD_COST_S]`` (a sane message cost)."""
PERIOD_SMOOTHING = 0.3
"""Weight of a new step-period sample in a trainer's smoothed step period."""


@dataclass(frozen=True)
class PullSample:
    """One donor's part of a completed pull, for the per-shard cost fit.

    Attributes:
        shards: Shard messages it sent.
        elapsed_s: Seconds from the request of its first shard to its last shard.
        modelled_s: What the plan's time model gives without the per-shard term:
            ``prop_s + bytes * trans_s_per_byte``.
    """

    shards: int
    elapsed_s: float
    modelled_s: float


def fit_per_shard_cost(samples: Sequence[PullSample]) -> float | None:
    """The per-shard cost c that best explains a pull: least squares, through the origin, of
    each donor's unexplained time ``elapsed_s - modelled_s`` on its shard count.

    Args:
        samples: One per donor that finished its part (shards > 0).

    Returns:
        ``sum(n * r) / sum(n * n)``, clipped to ``[0, MAX_PER_SHARD_COST_S]``; ``None`` without
        a usable sample. A bandwidth measured too low makes the residual negative: c is then 0.
    """
    usable = [x for x in samples if x.shards > 0 and x.elapsed_s >= 0.0 and x.modelled_s >= 0.0]
    if not usable:
        return None
    num = sum(x.shards * (x.elapsed_s - x.modelled_s) for x in usable)
    den = sum(float(x.shards) ** 2 for x in usable)
    return min(max(num / den, 0.0), MAX_PER_SHARD_COST_S)


@dataclass
class RoundClock:
    """A trainer's step boundaries, from its progress reports: when its current step began
    (it left ``update()``) and its smoothed step period.

    Attributes:
        step: The step of the last boundary seen.
        boundary_at: When that step's computing phase began (monotonic seconds).
        period_s: Smoothed seconds per step (``None`` before two boundaries).
        heard_at: When the last report came.
    """

    step: int
    boundary_at: float
    period_s: float | None = None
    heard_at: float = 0.0

    def observe(self, step: int, boundary_at: float, now: float) -> None:
        """A report of a trainer computing ``step`` since ``boundary_at``."""
        self.heard_at = now
        if step <= self.step or boundary_at <= self.boundary_at:
            return
        sample = (boundary_at - self.boundary_at) / (step - self.step)
        old = self.period_s
        self.period_s = sample if old is None else old + PERIOD_SMOOTHING * (sample - old)
        self.step, self.boundary_at = step, boundary_at

    def left_s(self, now: float) -> float | None:
        """Seconds until its next step boundary at ``now``, assuming it kept its period since
        the last boundary seen (``None`` without a period)."""
        period = self.period_s
        if period is None or period <= 0.0:
            return None
        since = max(0.0, now - self.boundary_at)
        return period - since % period


class ClusterMonitor:
    """The scheduler's view of the cluster topology and network resources.

    Besides the graph it keeps the replication planner's measured inputs: each trainer's
    :class:`RoundClock` (tau_sync, the time a donor needs to finish the step it is in) and the
    smoothed per-shard cost c fitted to completed pulls.
    """

    def __init__(self) -> None:
        self.g: nx.Graph = nx.Graph()
        self._members: dict[tuple[NodeState, ...], list[str]] = {}
        self.version = 0
        """Bumped by every change of a node's presence or state (caches key on it)."""
        self.clocks: dict[str, RoundClock] = {}
        self.per_shard_cost_s: float | None = None
        """The smoothed per-shard cost c measured from pulls (``None``: none measured yet)."""
        self.pulls_measured = 0
        """How many pulls the per-shard cost was fitted to."""
        self.pulls: dict[str, tuple[PullStatus, float]] = {}
        """Each joiner's last pull report and when it came (monotonic; ``status``'s joins)."""
        self.phases: dict[str, TrainerPhase] = {}
        """Each member's trainer's lifecycle phase, as its last progress report said."""
        self.catching_up: set[str] = set()
        """Joiners pulling a catch-up snapshot and replaying: left out of the sync policy
        until they ask to enter (``caught_up``)."""

    # -- measured replication inputs ---------------------------------------------------------

    def observe_progress(
        self, node: str, step: int, in_step: bool, phase_s: float, now: float
    ) -> None:
        """Takes a trainer's progress report: a computing one dates its last step boundary
        (``now - phase_s``), from which the step period is measured."""
        if in_step:
            clock = self.clocks.get(node)
            if clock is not None:
                clock.heard_at = now
            return
        boundary = now - max(0.0, phase_s)
        clock = self.clocks.get(node)
        if clock is None:
            self.clocks[node] = RoundClock(step, boundary, None, now)
        else:
            clock.observe(step, boundary, now)

    def step_now(self, node: str, now: float, max_age_s: float) -> tuple[int, float] | None:
        """``node``'s step at ``now`` extrapolated from its last boundary and period, with the
        period; ``None`` when unknown (no period measured, or no report for ``max_age_s``)."""
        clock = self.clocks.get(node)
        if clock is None or clock.period_s is None or clock.period_s <= 0.0:
            return None
        if now - clock.heard_at > max_age_s:
            return None
        return clock.step + int(max(0.0, now - clock.boundary_at) / clock.period_s), clock.period_s

    def tau_sync_s(self, node: str, now: float, max_age_s: float) -> float | None:
        """When ``node``'s trainer finishes the step it is in, from ``now`` (seconds): the
        time a donor needs before it can send. ``None`` when unknown (no period measured, or
        no report for ``max_age_s``)."""
        clock = self.clocks.get(node)
        if clock is None or now - clock.heard_at > max_age_s:
            return None
        return clock.left_s(now)

    def observe_pull(self, samples: Sequence[PullSample]) -> float | None:
        """Fits the per-shard cost to one completed pull and smooths it into
        :attr:`per_shard_cost_s`; returns the fit (``None``: nothing usable)."""
        fit = fit_per_shard_cost(samples)
        if fit is None:
            return None
        old = self.per_shard_cost_s
        self.per_shard_cost_s = fit if old is None else old + PER_SHARD_COST_SMOOTHING * (fit - old)
        self.pulls_measured += 1
        return fit

    def set_tau_sync(self, a: str, b: str, tau_sync_s: float | None) -> None:
        """Records the tau_sync of the donor ``a`` planned to send to ``b`` on their link
        (no-op without the link)."""
        if self.g.has_edge(a, b):
            self.g.edges[a, b]["tau_sync_s"] = tau_sync_s

    def _nodes_changed(self) -> None:
        self._members.clear()
        self.version += 1

    # -- nodes -----------------------------------------------------------------------------

    def add_node(
        self, node_id: str, address: str, state: NodeState, joined_at: float,
        public_key: str = "", sign_key: str = "",
    ) -> None:  # fmt: skip
        """Adds (or replaces) a node without links (``public_key``: its CURVE key, and
        ``sign_key``: its vote-signing key, bound to its id; empty without a cluster key)."""
        if node_id in self.g:
            self.g.remove_node(node_id)
        self._nodes_changed()
        self.g.add_node(
            node_id,
            address=address,
            state=state,
            joined_at=joined_at,
            resources=None,
            trainer=TrainerState.NONE,
            data_address=None,
            shard_address=None,
            tensor_sizes=None,
            public_key=public_key,
            sign_key=sign_key,
            data_key="",
        )

    def observe_pull_progress(self, node: str, pull: PullStatus, now: float) -> None:
        """A joiner's report of its pull's progress."""
        self.pulls[node] = (pull, now)

    def observe_phase(self, node: str, phase: TrainerPhase | None) -> None:
        """A member's report of its trainer's phase (``None``: it said none)."""
        if phase is not None:
            self.phases[node] = phase

    def remove_node(self, node_id: str) -> None:
        """Removes a node and its links (no-op if absent)."""
        self.clocks.pop(node_id, None)
        self.pulls.pop(node_id, None)
        self.phases.pop(node_id, None)
        if node_id in self.g:
            self.g.remove_node(node_id)
            self._nodes_changed()

    def set_state(self, node_id: str, state: NodeState) -> None:
        """Moves a node to ``state``.

        Raises:
            ChaosError: unknown node or a transition the state machine does not allow.
        """
        cur: NodeState = self.g.nodes[node_id]["state"]
        if state != cur and state not in NODE_TRANSITIONS[cur]:
            raise ChaosError(f"node {node_id}: transition {cur.value} -> {state.value} not allowed")
        if state != cur:
            self.g.nodes[node_id]["state"] = state
            self._nodes_changed()

    def set_resources(self, node_id: str, resources: Resources | None) -> None:
        """Records a node's latest resource report."""
        if node_id in self.g and resources is not None:
            self.g.nodes[node_id]["resources"] = resources

    def set_data_key(self, node_id: str, key: str) -> None:
        """Records the CURVE public key of a node's trainer (empty: none)."""
        self.g.nodes[node_id]["data_key"] = key

    def set_trainer(
        self,
        node_id: str,
        state: TrainerState,
        data_address: str | None,
        shard_address: str | None,
        tensor_sizes: list[int] | None = None,
    ) -> None:
        """Records a node's trainer registration (``tensor_sizes=None`` keeps the last sizes).

        Raises:
            ChaosError: unknown node or a transition the trainer state machine does not allow.
        """
        d = self.g.nodes[node_id]
        cur: TrainerState = d["trainer"]
        if state != cur and state not in TRAINER_TRANSITIONS.get(cur, frozenset()):
            raise ChaosError(f"trainer of {node_id}: {cur.value} -> {state.value} not allowed")
        d["trainer"] = state
        d["data_address"] = data_address
        d["shard_address"] = shard_address
        if tensor_sizes is not None:
            d["tensor_sizes"] = list(tensor_sizes)

    def trainer(self, node_id: str) -> TrainerState:
        """The node's trainer state (``none`` for an unknown node)."""
        if node_id not in self.g:
            return TrainerState.NONE
        t: TrainerState = self.g.nodes[node_id]["trainer"]
        return t

    def node_attr(self, node_id: str, key: str) -> Any:
        """One attribute of a node (KeyError if the node is unknown)."""
        return self.g.nodes[node_id].get(key)

    def trainer_members(
        self, states: tuple[TrainerState, ...] = (TrainerState.SYNCING, TrainerState.TRAINING)
    ) -> list[str]:
        """Sorted ids of the active members whose trainer is in ``states``."""
        return [m for m in self.members() if self.g.nodes[m]["trainer"] in states]

    def with_trainer_states(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        """``nodes`` with the trainer state this monitor holds now (between epochs, ``ready``
        changes it without a new view)."""
        return [
            msgspec.structs.replace(n, trainer=self.trainer(n.id).value) if n.id in self.g else n
            for n in nodes
        ]

    def has(self, node_id: str) -> bool:
        """Whether the node is in the view."""
        return node_id in self.g

    def state(self, node_id: str) -> NodeState:
        """The node's state (KeyError if unknown)."""
        s: NodeState = self.g.nodes[node_id]["state"]
        return s

    def address(self, node_id: str) -> str:
        """The node's address (KeyError if unknown)."""
        a: str = self.g.nodes[node_id]["address"]
        return a

    def public_key(self, node_id: str) -> str:
        """The CURVE key bound to the node's id (empty: no cluster key; KeyError if unknown)."""
        k: str = self.g.nodes[node_id]["public_key"]
        return k

    def members(self, states: tuple[NodeState, ...] = (NodeState.ACTIVE,)) -> list[str]:
        """Sorted ids of the nodes in ``states``."""
        cached = self._members.get(states)
        if cached is None:  # the control loop asks for every frame: computed once per change
            cached = sorted(n for n, d in self.g.nodes(data=True) if d["state"] in states)
            self._members[states] = cached
        return list(cached)

    def neighbors(self, node_id: str) -> list[str]:
        """Sorted ids of the node's neighbours over links that are up."""
        if node_id not in self.g:
            return []
        return sorted(v for v in self.g.neighbors(node_id) if self.g.edges[node_id, v]["up"])

    # -- links -----------------------------------------------------------------------------

    def set_link(
        self,
        a: str,
        b: str,
        *,
        up: bool = True,
        latency_s: float | None = None,
        bandwidth_bps: float | None = None,
    ) -> None:
        """Adds or updates a link; ``None`` measurements keep the previous value."""
        if a not in self.g or b not in self.g or a == b:
            return
        old: dict[str, Any] = dict(self.g.edges[a, b]) if self.g.has_edge(a, b) else {}
        self.g.add_edge(
            a,
            b,
            up=up,
            latency_s=latency_s if latency_s is not None else old.get("latency_s"),
            bandwidth_bps=bandwidth_bps if bandwidth_bps is not None else old.get("bandwidth_bps"),
            tau_sync_s=old.get("tau_sync_s"),
        )

    def set_bandwidth(self, a: str, b: str, bandwidth_bps: float | None) -> None:
        """Sets a link's bandwidth, ``None`` meaning not measured (no-op without the link)."""
        if self.g.has_edge(a, b):
            self.g.edges[a, b]["bandwidth_bps"] = bandwidth_bps

    def remove_link(self, a: str, b: str) -> bool:
        """Removes a link; returns whether it existed."""
        if self.g.has_edge(a, b):
            self.g.remove_edge(a, b)
            return True
        return False

    def link(self, a: str, b: str) -> dict[str, Any] | None:
        """The link's attributes, or ``None``."""
        return dict(self.g.edges[a, b]) if self.g.has_edge(a, b) else None

    def up_links(self, members: list[str]) -> list[LinkEstimate]:
        """The links that are up between ``members``, for the sync policy."""
        ms = set(members)
        return [
            LinkEstimate(a, b, d.get("bandwidth_bps"), d.get("latency_s"))
            for a, b, d in self.g.edges(data=True)
            if d["up"] and a in ms and b in ms
        ]

    def sync_links(self, members: list[str]) -> list[LinkEstimate]:
        """The links of the sync policy over ``members``: the overlay links between them that are
        up, plus a multi-hop link for each pair that the overlay joins only through non-members
        (bottleneck bandwidth, summed latency; ``None`` where a hop is not measured)."""
        ms = set(members)
        direct = self.up_links(members)
        have = {frozenset((x.a, x.b)) for x in direct}
        up = nx.Graph()
        up.add_nodes_from(self.members())
        up.add_edges_from(
            (u, v) for u, v, d in self.g.edges(data=True) if d["up"] and u in up and v in up
        )
        out = list(direct)
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                if frozenset((a, b)) in have:
                    continue
                via = up.subgraph((set(up.nodes) - ms) | {a, b})
                if nx.has_path(via, a, b):
                    lat, bw = self._path_estimate(nx.shortest_path(via, a, b))
                    out.append(LinkEstimate(a, b, bw, lat))
        return out

    def path_link(self, a: str, b: str) -> tuple[float | None, float | None]:
        """``(latency_s, bandwidth_bps)`` of the fewest-hop up path from ``a`` to ``b``: the link's
        own measurement for neighbours, summed latency and bottleneck bandwidth over several hops
        (``None`` where a hop is not measured, or when there is no path)."""
        up = nx.Graph()
        up.add_nodes_from(self.g.nodes)
        up.add_edges_from((u, v) for u, v, d in self.g.edges(data=True) if d["up"])
        if a not in up or b not in up or not nx.has_path(up, a, b):
            return None, None
        return self._path_estimate(nx.shortest_path(up, a, b))

    def _path_estimate(self, path: list[str]) -> tuple[float | None, float | None]:
        hops = [self.g.edges[u, v] for u, v in zip(path, path[1:], strict=False)]
        lats = [h.get("latency_s") for h in hops]
        bws = [h.get("bandwidth_bps") for h in hops]
        lat = None if any(x is None for x in lats) else float(sum(lats))
        bw = None if any(x is None for x in bws) else float(min(bws))
        return lat, bw

    def connected_without(self, a: str, b: str) -> bool:
        """Whether the active members stay connected over up links if ``a-b`` is removed."""
        members = self.members()
        h = nx.Graph()
        h.add_nodes_from(members)
        h.add_edges_from(
            (u, v)
            for u, v, d in self.g.edges(data=True)
            if d["up"] and {u, v} != {a, b} and u in h and v in h
        )
        return len(members) <= 1 or nx.is_connected(h)

    # -- views -----------------------------------------------------------------------------

    def to_view(self, epoch: int, term: int, scheduler: str | None) -> ClusterView:
        """The view of the nodes that are joining or active, and their links."""
        keep = set(self.members((NodeState.ACTIVE, NodeState.JOINING)))
        up: dict[str, list[str]] = {n: [] for n in self.g}  # one pass over the links
        for a, b, d in self.g.edges(data=True):
            if d["up"]:
                up[a].append(b)
                up[b].append(a)
        nodes = [
            NodeInfo(
                id=n,
                address=d["address"],
                state=d["state"].value,
                joined_at=d["joined_at"],
                neighbors=sorted(up[n]),
                resources=d["resources"],
                data_address=d["data_address"],
                shard_address=d["shard_address"],
                trainer=d["trainer"].value,
                public_key=d["public_key"],
                data_key=d["data_key"],
                sign_key=d["sign_key"],
            )
            for n, d in sorted(self.g.nodes(data=True))
            if n in keep
        ]
        links = [
            LinkInfo(
                a=min(a, b),
                b=max(a, b),
                bandwidth_bps=d.get("bandwidth_bps"),
                latency_s=d.get("latency_s"),
                tau_sync_s=d.get("tau_sync_s"),
                up=d["up"],
            )
            for a, b, d in sorted(self.g.edges(data=True), key=lambda e: (min(e[:2]), max(e[:2])))
            if a in keep and b in keep
        ]
        return ClusterView(epoch=epoch, term=term, scheduler=scheduler, nodes=nodes, links=links)

    @classmethod
    def from_view(cls, view: ClusterView) -> ClusterMonitor:
        """Rebuilds a monitor from a view (a new scheduler starts from its last copy)."""
        m = cls()
        for n in view.nodes:
            m.add_node(n.id, n.address, NodeState(n.state), n.joined_at, n.public_key,
                       n.sign_key)  # fmt: skip
            m.g.nodes[n.id]["data_key"] = n.data_key
            m.set_resources(n.id, n.resources)
            if n.trainer != "none":
                m.set_trainer(n.id, TrainerState(n.trainer), n.data_address, n.shard_address)
        for link in view.links:
            m.set_link(
                link.a,
                link.b,
                up=link.up,
                latency_s=link.latency_s,
                bandwidth_bps=link.bandwidth_bps,
            )
        return m
