"""The sockets of a :class:`~chaos.collectives.communicator.Communicator` and its peer links.

Internal to :mod:`chaos.collectives`. :class:`PeerSockets` owns the ZeroMQ context, the ROUTER
socket bound on the data endpoint (everything addressed to this node arrives there), one DEALER
socket per neighbour link (everything sent to that neighbour leaves there) with the monitor that
reports its connection state, the poller over them, and the peers reported dead from other
threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.collectives.config import CommunicatorConfig
from chaos.collectives.links import Link
from chaos.errors import PeerFailure

__all__ = ["PeerSockets"]

_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_NOBLOCK = int(zmq.NOBLOCK)


class PeerSockets:
    """The data endpoint and the links to the current neighbours.

    Args:
        config: The communicator's settings (node id, endpoint, socket options).

    Raises:
        zmq.ZMQError: the listen endpoint cannot be bound.
    """

    def __init__(self, config: CommunicatorConfig) -> None:
        self._config = config
        self.ctx = zmq.Context(config.io_threads)
        self._router = self.ctx.socket(zmq.ROUTER)
        try:
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its id
            self._router.setsockopt(zmq.RCVHWM, config.sndhwm)
            if config.sock_buf_bytes:
                self._router.setsockopt(zmq.RCVBUF, config.sock_buf_bytes)
            self._router.bind(config.listen)
        except BaseException:  # e.g. the port is taken: release what was opened, then raise
            self._router.close(linger=0)
            self.ctx.term()
            raise
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound data endpoint (with the port chosen for a ``*`` wildcard)."""
        self.poller = zmq.Poller()
        """Polls the ROUTER socket and the link monitors (and the payload lanes' sockets)."""
        self.poller.register(self._router, zmq.POLLIN)
        self._links: dict[str, Link] = {}
        self._dead: set[str] = set()
        self._dead_lock = threading.Lock()

    # ------------------------------------------------------------------ links

    def peers(self) -> list[str]:
        """The neighbours with a link, in the order the links were opened."""
        return list(self._links)

    def __contains__(self, peer: object) -> bool:
        return peer in self._links

    def link(self, peer: str) -> Link | None:
        """The link to ``peer``, or ``None``."""
        return self._links.get(peer)

    def socket(self, peer: str) -> zmq.Socket | None:
        """The DEALER socket of the link to ``peer``, or ``None``."""
        link = self._links.get(peer)
        return None if link is None else link.socket

    def sockets(self) -> list[zmq.Socket]:
        """Every link's DEALER socket."""
        return [link.socket for link in self._links.values()]

    def connect(self, wanted: Mapping[str, str], on_close: Callable[[str], None]) -> None:
        """Edits the links in place to those of ``wanted`` (peer -> data endpoint).

        Links that stay (same peer, same address) keep their socket; the others are closed
        (``on_close(peer)`` is called just before) and the new ones opened, in peer order.
        """
        for peer in [p for p, link in self._links.items() if wanted.get(p) != link.address]:
            on_close(peer)
            self._close_link(self._links.pop(peer))
        for peer, address in sorted(wanted.items()):
            if peer not in self._links:
                self._links[peer] = self._open_link(peer, address)

    def _open_link(self, peer: str, address: str) -> Link:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._config.node_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._config.sndhwm)
        if self._config.sock_buf_bytes:
            sock.setsockopt(zmq.SNDBUF, self._config.sock_buf_bytes)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(address)
        self.poller.register(monitor, zmq.POLLIN)
        return Link(peer, address, sock, monitor)

    def _close_link(self, link: Link) -> None:
        self.poller.unregister(link.monitor)
        link.socket.disable_monitor()
        link.monitor.close(linger=0)
        link.socket.close(linger=0)

    # ------------------------------------------------------------------ failures

    def report_dead(self, peer: str) -> None:
        """Marks a peer dead until :meth:`clear_dead`; thread-safe."""
        with self._dead_lock:
            self._dead.add(peer)

    def clear_dead(self) -> None:
        """Forgets the dead-peer reports (a new epoch is authoritative)."""
        with self._dead_lock:
            self._dead.clear()

    def check_failed(self) -> None:
        """Raises when a neighbour was reported dead or its connection was lost.

        Raises:
            PeerFailure: naming the first such neighbour (dead reports first).
        """
        me = self._config.node_id
        with self._dead_lock:
            dead = sorted(self._dead & self._links.keys())
        if dead:
            raise PeerFailure(dead[0], "reported dead", reported_by=me)
        for link in self._links.values():
            if link.lost:
                raise PeerFailure(link.peer, "connection lost", reported_by=me)

    def drain_monitors(self, events: Mapping[object, int] | None = None) -> None:
        """Applies the monitors' connection events (only the links in ``events``, if given)."""
        for link in self._links.values():
            if events is None or link.monitor in events:
                _drain_monitor(link)

    # ------------------------------------------------------------------ receiving

    def recv_nowait(self) -> list[zmq.Frame]:
        """The next message on the data endpoint, without waiting.

        Raises:
            zmq.Again: none is queued.
        """
        return self._router.recv_multipart(_NOBLOCK, copy=False)

    def poll(self, timeout_ms: int) -> dict[object, int]:
        """Polls the endpoint, the monitors and what else is registered; applies the link
        monitors' events.

        Returns:
            The ready sockets (and file descriptors) with their events.
        """
        events: dict[object, int] = dict(self.poller.poll(timeout_ms))
        self.drain_monitors(events)
        return events

    # ------------------------------------------------------------------ lifecycle

    def close_links(self, on_close: Callable[[str], None]) -> None:
        """Closes every link (``on_close(peer)`` is called just before each)."""
        for link in self._links.values():
            on_close(link.peer)
            self._close_link(link)
        self._links.clear()

    def close(self) -> None:
        """Closes the endpoint and terminates the context (close every other socket first)."""
        self._router.close(linger=0)
        self.ctx.term()


def _drain_monitor(link: Link) -> None:
    while link.monitor.poll(0):
        event = recv_monitor_message(link.monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            link.connected, link.lost = True, False
        elif event == zmq.EVENT_DISCONNECTED and link.connected:
            link.lost = True
