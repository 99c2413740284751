"""The notices a :class:`~chaos.collectives.communicator.Communicator` sends outside a round's
data flow, and the state that keeps each one to once per round.

Internal to :mod:`chaos.collectives`. Three notices help members that are not in the same round:

* ``NEWER`` tells a peer still running this step under an older epoch that this node runs it
  under a newer one (it can then give up its round instead of waiting out the timeout). A peer
  that is no longer a neighbour gets it through a notice-only socket of its own.
* ``BEHIND`` asks a neighbour a step ahead for the result of the step this node is still in.
* ``RESULT`` sends a neighbour a step behind the kept result of the step this node completed.
  A node that completed a step with a neighbour's kept result passes it on to its other
  neighbours still in that step (they wait for it from this node).

``ABORT`` tells the neighbours that this node gave a round up. :func:`sort_early` sorts the
frames and notices that arrived before their round started (pure: no sockets).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq

from chaos.collectives.config import CollectiveStats
from chaos.collectives.frames import Op, encode_header
from chaos.collectives.links import Frame, routing_id, send_notice
from chaos.security import Security
from chaos.sockets import keep_alive

__all__ = ["EarlySort", "LinkSockets", "PeerNotices", "sort_early"]

Key = tuple[int, int]


@dataclass
class EarlySort:
    """What :func:`sort_early` made of the frames that came before a round."""

    ready: deque[Frame] = field(default_factory=deque)
    """The round's own frames, in arrival order."""
    later: deque[Frame] = field(default_factory=deque)
    """Frames and notices of later rounds, kept for them."""
    newer_epoch: int | None = None
    """The newest epoch a peer runs this same step under (then nobody completes this round)."""
    stale_peers: list[str] = field(default_factory=list)
    """Peers that sent this step under an older epoch (to be told of this one)."""
    stale: int = 0
    """Frames dropped as older than the round."""


def sort_early(early: Iterable[Frame], key: Key) -> EarlySort:
    """Sorts the frames kept before the round ``key`` started.

    Args:
        early: The kept frames, in arrival order.
        key: The round's ``(epoch, step)``.

    Returns:
        The round's frames, the later ones, the newer epoch seen for this step, and the peers
        still in an older epoch of it.
    """
    out = EarlySort()
    for f in early:
        k = f.header.key
        if f.header.op == Op.NEWER:  # a notice that came before its step: apply or drop
            if k[1] == key[1] and k[0] > key[0]:
                out.newer_epoch = max(out.newer_epoch or 0, k[0])
            elif k > key:
                out.later.append(f)
            continue
        if k == key:
            out.ready.append(f)
        elif k < key:
            out.stale += 1
            if k[1] == key[1]:
                out.stale_peers.append(f.peer)
        else:
            if k[1] == key[1]:
                out.newer_epoch = max(out.newer_epoch or 0, k[0])
            out.later.append(f)
    return out


class LinkSockets(Protocol):
    """The data links :class:`PeerNotices` sends through (a
    :class:`~chaos.collectives.peers.PeerSockets` is one)."""

    def socket(self, peer: str) -> zmq.Socket | None:
        """The data link's socket to ``peer``, or ``None`` when it is not a neighbour."""
        ...

    def sockets(self) -> list[zmq.Socket]:
        """Every data link's socket."""
        ...

    def peers(self) -> list[str]:
        """The neighbours (one data link each)."""
        ...


class PeerNotices:
    """Sends NEWER, BEHIND, RESULT and ABORT notices, each at most once per peer and round.

    Args:
        ctx: The communicator's ZeroMQ context (for notice-only sockets).
        node_id: This node's id (the notice sockets' routing id derives from it).
        stats: The communicator's counters (``results_sent``).
        links: The data links to the neighbours.
        security: Makes the notice-only sockets CURVE clients of the cluster (default: plain).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        node_id: str,
        stats: CollectiveStats,
        links: LinkSockets,
        security: Security | None = None,
    ) -> None:
        self._ctx = ctx
        self._security = security if security is not None else Security()
        self._node_id = node_id
        self._stats = stats
        self._links = links
        self._addresses: Mapping[str, str] = {}  # the members' data endpoints
        self._sockets: dict[str, zmq.Socket] = {}  # address -> notice-only DEALER
        self._used: dict[str, int] = {}  # address -> the topology epoch it was last used in
        self._epochs: tuple[int, int] = (-1, -1)  # the previous and the current topology epoch
        self._told: set[tuple[str, Key]] = set()
        self._offered: set[str] = set()  # neighbours sent the kept result this round
        self._asked: set[str] = set()  # neighbours asked for this round's result
        # the last completed round's step and result, for a neighbour a step behind
        self._kept: tuple[int, torch.Tensor] | None = None
        # the previous epoch's neighbours, told of this node's first round in a new epoch
        self._announce: list[str] = []

    def new_round(self) -> None:
        """Forgets which peers were told what: a new round starts."""
        self._told.clear()
        self._offered.clear()
        self._asked.clear()

    def keep(self, step: int, result: torch.Tensor | None) -> None:
        """Keeps ``result`` of ``step`` for a neighbour that never got it (``None``: keep none)."""
        self._kept = None if result is None else (step, result)

    def tell_newer(self, peer: str, key: Key) -> None:
        """Tells ``peer``, still in an older epoch of this step, that this node runs ``key``.

        Without this, members split across an epoch boundary can wait on each other until the
        step timeout (e.g. a tree root in the new epoch never sends down to children in the
        old one). Once per peer and round.

        A neighbour is told through its data link, another member through a notice-only
        socket; a peer that is not a member is told nothing.

        Args:
            peer: The member to tell.
            key: The ``(epoch, step)`` this node runs.
        """
        if (peer, key) in self._told:
            return
        link = self._links.socket(peer)
        sock = link if link is not None else self._notice_socket(self._addresses.get(peer))
        if sock is None:
            return
        self._told.add((peer, key))
        send_notice(sock, Op.NEWER, key)

    def _notice_socket(self, address: str | None) -> zmq.Socket | None:
        """A socket to a member that is not a neighbour in this epoch (in its older epoch it
        may still wait on us). Its own routing id, so that it never clashes with a data link."""
        if address is None:
            return None
        self._used[address] = self._epochs[1]
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, routing_id(self._node_id, notice=True))
            sock.setsockopt(zmq.LINGER, 0)
            keep_alive(sock)
            self._security.client(sock)
            sock.connect(address)
            self._sockets[address] = sock
        return sock

    def ask_result(self, peer: str, key: Key) -> None:
        """Asks a neighbour a step ahead for the result of ``key``'s step (once per round)."""
        link = self._links.socket(peer)
        if link is None or peer in self._asked:
            return
        self._asked.add(peer)
        send_notice(link, Op.BEHIND, key)

    def probe(self, peer: str, key: Key) -> None:
        """Asks ``peer``, which this node's round ``key`` has heard nothing from for a while,
        for the result of ``key``'s step: a neighbour that completed it answers with its kept
        result, any other ignores the notice. The caller paces the probes."""
        link = self._links.socket(peer)
        if link is None:
            return
        send_notice(link, Op.BEHIND, key)
        self._stats.quiet_probes += 1

    def offer_result(self, peer: str, key: Key) -> None:
        """Sends a neighbour still running ``key`` the kept result of that step (once per
        round; nothing when the kept result is of another step). A member that is no longer a
        neighbour (the topology changed right after the step) gets it through a notice-only
        socket."""
        kept = self._kept
        if kept is None or kept[0] != key[1] or peer in self._offered:
            return
        # a former neighbour (the topology changed right after the step) has no data link
        link = self._links.socket(peer) or self._notice_socket(self._addresses.get(peer))
        if link is None:
            return
        self._offered.add(peer)
        flat = kept[1].contiguous().reshape(-1)
        header = encode_header(Op.RESULT, flat.dtype, 0, key[0], key[1], 0, flat.numel())
        try:
            link.send(header, zmq.SNDMORE | zmq.NOBLOCK)
            link.send(flat.view(torch.uint8).numpy().tobytes(), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        self._stats.results_sent += 1

    def pass_on(self, key: Key, source: str) -> None:
        """Offers the kept result of round ``key``, which this node got from ``source`` instead
        of completing the round, to every other neighbour not known to be a step ahead.

        A neighbour that sent this node its part of the round waits for the result from it,
        and a node that caught up sends nothing more in that round: without this, such a
        neighbour (a child in a tree whose parent caught up) waited until its quiet probe.
        A neighbour that already has the result drops it (see :meth:`Inbox.route
        <chaos.collectives.inbox.Inbox.route>`).

        Args:
            key: The round that completed with ``source``'s kept result.
            source: The neighbour that sent it.
        """
        for peer in self._links.peers():
            if peer != source and peer not in self._asked:
                self.offer_result(peer, key)

    def abort(self, key: Key, failed: str) -> None:
        """Tells every neighbour that this node gave up round ``key`` because of ``failed``
        (best effort: a neighbour that misses it times out instead)."""
        for sock in self._links.sockets():
            send_notice(sock, Op.ABORT, key, failed.encode())

    def announce_later(self, peers: Iterable[str]) -> None:
        """Keeps ``peers`` (the previous epoch's neighbours) to be told of this node's first
        round in the new epoch (see :meth:`announce`)."""
        self._announce = sorted(peers)

    def announce(self, key: Key) -> None:
        """Tells the peers kept by :meth:`announce_later` that this node runs ``key`` (once).

        Members still in the old epoch may wait on this node there, and frames may never cross
        between the two trees (a node waiting for children sends nothing).
        """
        announce, self._announce = self._announce, []
        for peer in announce:
            self.tell_newer(peer, key)

    @property
    def notice_sockets(self) -> int:
        """The notice-only sockets open (to members that are not neighbours)."""
        return len(self._sockets)

    def retain(self, addresses: Mapping[str, str], epoch: int) -> None:
        """Takes the members' data endpoints (``addresses``: member -> endpoint) of the
        topology of ``epoch`` and closes the notice sockets to the endpoints of members that
        left, and those used in neither this topology nor the one before.

        A notice socket serves the rounds right after a topology change (a member left behind
        in the old epoch); kept for every member ever told, a long-lived trainer would hold
        one per member (a soak saw its open files grow by a third at an unchanged cluster size).
        """
        self._addresses = addresses
        if epoch != self._epochs[1]:
            self._epochs = (self._epochs[1], epoch)
        kept = set(addresses.values())
        recent = self._epochs[0]
        for address in [a for a in self._sockets
                        if a not in kept or self._used.get(a, -1) < recent]:  # fmt: skip
            self._sockets.pop(address).close(linger=0)
            self._used.pop(address, None)

    def close(self) -> None:
        """Closes every notice socket."""
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._used.clear()
