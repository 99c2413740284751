"""When a communicator's data frames take the payload lanes, and the lanes' life with the links.

Internal to :mod:`chaos.collectives`. :class:`LaneSwitch` opens the
:class:`~chaos.collectives.lanes.Lanes` at the first round of a large enough tensor, decides per
round whether its chunks go over them, offers them to the neighbours, and passes the lanes'
part of the receive loop, the end of a round and the links' changes on to them. Without lanes
(turned off, a non-TCP endpoint, or before the first large round) every method is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import zmq

from chaos.collectives.config import CommunicatorConfig
from chaos.collectives.frames import Op
from chaos.collectives.lanes import InLane, Lanes, endpoint_host, open_lanes
from chaos.collectives.links import LanePayload, send_notice
from chaos.errors import PeerTimeout, ProtocolError

__all__ = ["LaneSwitch"]

SocketOf = Callable[[str], "zmq.Socket | None"]


class LaneSwitch:
    """A communicator's payload lanes, opened when first needed.

    Args:
        config: The communicator's settings (``lanes``, ``lane_min_bytes``, timeouts).
        address: The communicator's bound data endpoint (the lanes listen on its host).
        sealed: Seal every lane with AES-256-GCM (the communicator has a cluster key; see
            :mod:`chaos.collectives.lanes`).
    """

    def __init__(self, config: CommunicatorConfig, address: str, sealed: bool = False) -> None:
        self._config = config
        self._address = address
        self.sealed = sealed
        self.lanes: Lanes | None = None
        """The lanes, once opened at the first round of a large tensor (for inspection)."""
        self._wanted = config.lanes
        self.active = False
        """Whether this round's tensor is large enough for the lanes (and they are open)."""

    def choose(self, wire_bytes: int) -> bool:
        """Decides whether this round's chunks take the lanes (opening them at the first such
        round) and returns it (also in :attr:`active`)."""
        self.active = self._ready(wire_bytes)
        return self.active

    def _ready(self, wire_bytes: int) -> bool:
        if not self._wanted or wire_bytes < self._config.lane_min_bytes:
            return False
        if self.lanes is None:
            cfg = self._config
            self.lanes = open_lanes(
                cfg.node_id, self._address, cfg.timeout_s, cfg.poll_slice_s, self.sealed
            )
            self._wanted = self.lanes is not None  # do not try again every round
        return self.lanes is not None

    def offer(self, senders: Iterable[str], key: tuple[int, int], socket_of: SocketOf) -> None:
        """Offers a lane to each neighbour in ``senders`` that needs one, when this round uses
        the lanes (a LANE notice through its link)."""
        if self.lanes is None or not self.active:
            return
        for peer in senders:
            sock = socket_of(peer)
            if sock is not None and self.lanes.wants_offer(peer):
                send_notice(sock, Op.LANE, key, self.lanes.offer(peer))

    def on_offer(self, peer: str, address: str | None, raw: bytes | memoryview) -> bool:
        """A neighbour (data endpoint ``address``; ``None``: not a neighbour) offers a lane:
        connect to it (in the lane's own thread).

        Returns:
            ``False`` when the offer was malformed.
        """
        if self.lanes is None or address is None:
            return True
        try:
            self.lanes.on_offer(peer, endpoint_host(address), raw)
        except ProtocolError:
            return False
        return True

    def send(
        self, sock: zmq.Socket, peer: str, header: bytes | zmq.Frame,
        payload: zmq.Frame | memoryview | LanePayload,
    ) -> bool:  # fmt: skip
        """Queues a data frame on the lane to ``peer`` when this round uses the lanes.

        Returns:
            ``False``: no usable lane, send the frame through ZeroMQ (``sock``).

        Raises:
            PeerTimeout: resending a dead lane's frames through ZeroMQ found the queue full.
        """
        if not self.active or self.lanes is None:
            return False
        raw = header.bytes if isinstance(header, zmq.Frame) else header
        return self.lanes.send(sock, peer, raw, payload)

    # ------------------------------------------------------------------ the receive loop

    def before_poll(self, socket_of: SocketOf, poller: zmq.Poller) -> None:
        """Resends a dead lane's frames through ZeroMQ and registers the lanes' sockets.

        Raises:
            PeerTimeout: a link's queue is full.
        """
        if self.lanes is not None:
            self.lanes.resend_dead(socket_of)
            self.lanes.sync_poller(poller)

    def on_readable(self, events: Mapping[object, int]) -> InLane | None:
        """The readable incoming lane among the polled ``events``, if any."""
        if self.lanes is None or not events:
            return None
        return self.lanes.on_readable({k for k in events if isinstance(k, int)})

    def close_incoming(self, peer: str) -> None:
        """Closes the incoming lane from ``peer`` (its stream can no longer be trusted)."""
        if self.lanes is not None:
            self.lanes.close_incoming(peer)

    # ------------------------------------------------------------------ round end, links

    def drain(self, timeout_s: float, socket_of: SocketOf, node_id: str) -> None:
        """Waits until every frame queued on a lane is written.

        Raises:
            PeerTimeout: a lane's frames were not all taken within ``timeout_s``.
        """
        if self.lanes is None:
            return
        peer = self.lanes.drain(timeout_s, socket_of)
        if peer is not None:
            raise PeerTimeout(peer, "final frames not taken", reported_by=node_id)

    def cancel(self) -> None:
        """Drops the frames the lanes have not started to write (see :meth:`Lanes.cancel`)."""
        if self.lanes is not None:
            self.lanes.cancel(min(1.0, self._config.timeout_s))

    def drop(self, peer: str) -> None:
        """Forgets ``peer``'s lanes (its link closes)."""
        if self.lanes is not None:
            self.lanes.drop(peer)

    def close(self) -> None:
        """Closes every lane and the listener."""
        if self.lanes is not None:
            self.lanes.close()
