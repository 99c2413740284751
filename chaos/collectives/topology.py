"""The reduction structure a :class:`~chaos.collectives.Communicator` runs on.

A :class:`Topology` is the data plane's view of the sync policy: which members take part, whether
they reduce around a ring or up and down a tree, the membership epoch it belongs to, and the
address of every member's data endpoint. It is immutable and validated on construction.

:func:`topology_from_sync_policy` converts the pure scheduler's
:class:`chaos.scheduling.sync_policy.SyncPolicy` into one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

Kind = Literal["ring", "tree"]


class SyncPolicyView(Protocol):
    """What :func:`topology_from_sync_policy` reads of a sync policy (a
    :class:`chaos.scheduling.sync_policy.SyncPolicy` is one; the data plane does not import the
    scheduler, which pulls in networkx)."""

    @property
    def kind(self) -> str:
        """``"ring"``, ``"tree"`` or ``"single"``."""
        ...

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes it covers, sorted."""
        ...

    @property
    def parents(self) -> tuple[tuple[str, str | None], ...]:
        """The tree's (node, parent) pairs."""
        ...

    @property
    def ring(self) -> tuple[str, ...]:
        """The ring order."""
        ...

    @property
    def connected(self) -> bool:
        """Whether the overlay is connected."""
        ...


@dataclass(frozen=True)
class Topology:
    """One reduction structure over overlay links, at one membership epoch.

    Args:
        kind: ``"ring"`` (reduce-scatter then allgather around ``ring_order``) or ``"tree"``
            (pipelined reduce up to the root, broadcast down, along ``parent``).
        members: The member node ids (any order; stored sorted).
        addresses: Each member's data endpoint, ``tcp://HOST:PORT``.
        epoch: The membership epoch; every frame carries it, and frames of an older epoch are
            dropped.
        ring_order: For a ring: every member once, in ring order (a member sends to the next).
        parent: For a tree: each member's parent, ``None`` for the (single) root.
        keys: Each member's CURVE public key (Z85 text, 40 characters), or ``None``. With keys
            (a cluster with a cluster key), a communicator accepts a frame only from the
            connection authenticated with the key of the member it claims to come from, so a
            key holder cannot send as another member.

    Raises:
        ValueError: empty or duplicate members, a missing address, a negative epoch, a ring order
            that is not a permutation of the members, a parent map that is not one tree
            spanning exactly the members, or keys that miss a member or are not Z85 keys.
    """

    kind: Kind
    members: tuple[str, ...]
    addresses: Mapping[str, str]
    epoch: int
    ring_order: tuple[str, ...] | None = None
    parent: Mapping[str, str | None] | None = None
    keys: Mapping[str, str] | None = None
    _children: Mapping[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ("ring", "tree"):
            raise ValueError(f"topology kind must be 'ring' or 'tree', not {self.kind!r}")
        if not self.members:
            raise ValueError("a topology needs at least one member")
        if len(set(self.members)) != len(self.members):
            raise ValueError("duplicate members")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, not {self.epoch!r}")
        object.__setattr__(self, "members", tuple(sorted(self.members)))
        missing = [m for m in self.members if not self.addresses.get(m)]
        if missing:
            raise ValueError(f"no data address for members {missing}")
        object.__setattr__(
            self, "addresses", MappingProxyType({m: self.addresses[m] for m in self.members})
        )
        if self.keys is not None:
            bad = [m for m in self.members if not _is_z85_key(self.keys.get(m))]
            if bad:
                raise ValueError(f"no CURVE public key (40 Z85 characters) for members {bad}")
            object.__setattr__(
                self, "keys", MappingProxyType({m: self.keys[m] for m in self.members})
            )
        children: dict[str, list[str]] = {m: [] for m in self.members}
        if self.kind == "ring":
            if self.ring_order is None or sorted(self.ring_order) != list(self.members):
                raise ValueError("ring_order must list every member exactly once")
            object.__setattr__(self, "ring_order", tuple(self.ring_order))
            object.__setattr__(self, "parent", None)
        else:
            self._check_tree(children)
            object.__setattr__(self, "ring_order", None)
        object.__setattr__(
            self, "_children", MappingProxyType({k: tuple(sorted(v)) for k, v in children.items()})
        )

    def _check_tree(self, children: dict[str, list[str]]) -> None:
        parent = self.parent
        if parent is None or set(parent) != set(self.members):
            raise ValueError("parent must map every member (the root to None)")
        roots = [m for m, p in parent.items() if p is None]
        if len(roots) != 1:
            raise ValueError(f"a tree needs exactly one root, found {len(roots)}")
        for m, p in parent.items():
            if p is not None:
                if p not in children or p == m:
                    raise ValueError(f"parent of {m!r} is {p!r}, not another member")
                children[p].append(m)
        seen = {roots[0]}
        frontier = [roots[0]]
        while frontier:
            nxt = [c for f in frontier for c in children[f]]
            seen.update(nxt)
            frontier = nxt
        if len(seen) != len(self.members):
            raise ValueError("parent map has a cycle or does not span the members")
        object.__setattr__(self, "parent", MappingProxyType(dict(parent)))

    @property
    def root(self) -> str | None:
        """The tree's root (``None`` for a ring)."""
        if self.parent is None:
            return None
        return next(m for m, p in self.parent.items() if p is None)

    def children(self, node: str) -> tuple[str, ...]:
        """The node's children in a tree, sorted (empty for a ring or a leaf)."""
        return self._children[node]

    def ring_neighbours(self, node: str) -> tuple[str, str]:
        """Returns ``(left, right)``: the ring member ``node`` receives from and sends to.

        Raises:
            ValueError: not a ring, or ``node`` is not a member.
        """
        if self.ring_order is None or node not in self.ring_order:
            raise ValueError(f"{node!r} is not on a ring of this topology")
        i = self.ring_order.index(node)
        n = len(self.ring_order)
        return self.ring_order[(i - 1) % n], self.ring_order[(i + 1) % n]

    def senders(self, node: str) -> list[str]:
        """The members that send data frames to ``node``: its left neighbour on a ring; its
        children (reduce) and its parent (broadcast) in a tree.

        Raises:
            ValueError: ``node`` is not on this ring.
        """
        if self.kind == "ring":
            return [self.ring_neighbours(node)[0]]
        up = self.parent[node] if self.parent is not None else None
        return [*self.children(node), *([up] if up is not None else [])]

    def neighbours(self, node: str) -> frozenset[str]:
        """The members ``node`` exchanges frames with (its overlay links in this structure).

        Raises:
            ValueError: ``node`` is not a member.
        """
        if node not in self.addresses:
            raise ValueError(f"{node!r} is not a member of this topology")
        if len(self.members) == 1:
            return frozenset()
        if self.kind == "ring":
            return frozenset(self.ring_neighbours(node))
        if self.parent is None:  # pragma: no cover - guaranteed by __post_init__
            raise ValueError("tree without parents")
        up = self.parent[node]
        return frozenset(self.children(node)) | (frozenset() if up is None else frozenset([up]))


def _is_z85_key(key: object) -> bool:
    """Whether ``key`` looks like a Z85-encoded CURVE public key."""
    return isinstance(key, str) and len(key) == 40 and key.isascii() and key.isprintable()


def topology_from_sync_policy(
    policy: SyncPolicyView,
    addresses: Mapping[str, str],
    epoch: int,
    keys: Mapping[str, str] | None = None,
) -> Topology:
    """Converts the scheduler's sync policy into the data plane's topology.

    Args:
        policy: A :class:`chaos.scheduling.sync_policy.SyncPolicy`.
        addresses: Data endpoint of every node of the policy.
        epoch: The membership epoch the policy was issued in (the policy itself carries none).
        keys: Each node's CURVE public key (see :attr:`Topology.keys`), or ``None``.

    Returns:
        The topology. A ``"single"`` policy becomes a one-member ring.

    Raises:
        ValueError: the policy is for a disconnected overlay (a forest cannot reduce globally),
            is of an unknown kind, or does not validate as a topology.
    """
    if not policy.connected:
        raise ValueError("the sync policy covers a disconnected overlay")
    if policy.kind == "ring":
        return Topology("ring", policy.nodes, addresses, epoch, ring_order=policy.ring,
                        keys=keys)  # fmt: skip
    if policy.kind == "single":
        return Topology("ring", policy.nodes, addresses, epoch, ring_order=policy.nodes,
                        keys=keys)  # fmt: skip
    if policy.kind == "tree":
        return Topology("tree", policy.nodes, addresses, epoch, parent=dict(policy.parents),
                        keys=keys)  # fmt: skip
    raise ValueError(f"unknown sync policy kind {policy.kind!r}")
