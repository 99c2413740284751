"""The sockets of a :class:`~chaos.collectives.communicator.Communicator` and its peer links.

Internal to :mod:`chaos.collectives`. :class:`PeerSockets` owns the ZeroMQ context, the ROUTER
socket bound on the data endpoint (everything addressed to this node arrives there), one DEALER
socket per neighbour link (everything sent to that neighbour leaves there) with the monitor that
reports its connection state, the poller over them, and the peers reported dead from other
threads.

With a cluster key (:class:`~chaos.security.Security`) the ROUTER is a CURVE server of the
cluster and every DEALER a CURVE client: a connection without the key fails in the handshake
(logged, counted in :attr:`CollectiveStats.handshake_failures
<chaos.collectives.config.CollectiveStats.handshake_failures>`), and every frame carries the
public key its connection was authenticated with. When the topology names the members' keys
(:attr:`Topology.keys <chaos.collectives.topology.Topology.keys>`), a frame is handed on only
if that key is the key of the member its routing id claims; frames of a later epoch, whose
members this node does not know yet, wait for that epoch's topology to vouch for them, within
the bounds of the communicator's :class:`~chaos.collectives.early.EarlyBudget` (bytes, count,
epochs ahead).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.collectives.config import CollectiveStats, CommunicatorConfig
from chaos.collectives.early import EarlyBudget, parts_bytes
from chaos.collectives.frames import decode_header
from chaos.collectives.links import Link, member_of, routing_id
from chaos.errors import PeerFailure, ProtocolError
from chaos.security import (
    HANDSHAKE_FAILED_EVENTS,
    HandshakeRefusal,
    HandshakeWatch,
    Security,
    authenticated_key,
    handshake_error,
)
from chaos.sockets import keep_alive, start_zero_copy_collector

__all__ = ["PeerSockets"]

log = logging.getLogger("chaos.collectives")

_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED_EVENTS
_REFUSALS_LOGGED = 3
"""The data endpoint logs this many refused handshakes; it only counts the later ones."""
_NOBLOCK = int(zmq.NOBLOCK)
HANDSHAKE_IVL_MS = 5_000
"""A data-port connection must finish its handshake within this (milliseconds)."""
MIN_MAX_MSG_BYTES = 64 << 20
"""Floor of the data port's frame cap (``MAXMSGSIZE``: four chunks, at least this)."""
_NO_KEY = "it has no or a different cluster key"


FLUSH_ON_CLOSE_S = 2.0
"""A link that a new topology removes keeps sending what it has queued for up to this long (its
socket closes in the background): the last round's result frames to a former neighbour still
reach it. Dropped at once, they left that neighbour a step behind the others, every side
waiting on another step."""


class PeerSockets:
    """The data endpoint and the links to the current neighbours.

    Args:
        config: The communicator's settings (node id, endpoint, socket options).
        stats: The communicator's counters (``handshake_failures``,
            ``dropped_unauthenticated``).
        security: The cluster key and this process's keypair (default: none, plain sockets).
        budget: Bounds the frames held for a later epoch (shared with the communicator's
            :class:`~chaos.collectives.inbox.Inbox`; default: one of its own).

    Raises:
        zmq.ZMQError: the listen endpoint cannot be bound.
    """

    def __init__(
        self,
        config: CommunicatorConfig,
        stats: CollectiveStats | None = None,
        security: Security | None = None,
        budget: EarlyBudget | None = None,
    ) -> None:
        self._config = config
        self._stats = stats if stats is not None else CollectiveStats()
        self._budget = budget if budget is not None else EarlyBudget(config, self._stats)
        self.security = security if security is not None else Security()
        start_zero_copy_collector()  # payloads go out uncopied: its descriptors from now on
        self.ctx = zmq.Context(config.io_threads)
        self.security.authenticate(self.ctx)
        self._router = self.ctx.socket(zmq.ROUTER)
        self._handshakes: HandshakeWatch | None = None
        try:
            self._router.setsockopt(zmq.LINGER, 0)
            keep_alive(self._router)  # drops a peer's half-open connection
            # Plain: a restarted peer takes its id over. With a key, a connection never takes an
            # id in use: otherwise a key holder claiming a member's id would cut that member's
            # connection off (its frames are dropped anyway when the topology names the keys).
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 0 if self.security.enabled else 1)
            self._router.setsockopt(zmq.RCVHWM, config.sndhwm)
            # a connection that has not completed its handshake within this is dropped, so
            # idle strangers do not hold the trainer's descriptors for libzmq's 30 s
            self._router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            # a frame is at most one chunk: a far larger one is a stranger's or a forger's, and
            # ZeroMQ drops its connection before it is read into memory
            self._router.setsockopt(zmq.MAXMSGSIZE, max(4 * config.chunk_bytes, MIN_MAX_MSG_BYTES))
            if config.sock_buf_bytes:
                self._router.setsockopt(zmq.RCVBUF, config.sock_buf_bytes)
            self.security.server(self._router)
            if self.security.enabled:
                self._handshakes = HandshakeWatch(
                    self._router, on_refused=self._count_refusal, report=self._log_refusal,
                    log_first=_REFUSALS_LOGGED,
                )  # fmt: skip
            self._router.bind(config.listen)
        except BaseException:  # e.g. the port is taken: release what was opened, then raise
            self._close_router()
            raise
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound data endpoint (with the port chosen for a ``*`` wildcard)."""
        self.poller = zmq.Poller()
        """Polls the ROUTER socket and the link monitors (and the payload lanes' sockets)."""
        self.poller.register(self._router, zmq.POLLIN)
        if self._handshakes is not None:
            self.poller.register(self._handshakes.monitor, zmq.POLLIN)
        self._links: dict[str, Link] = {}
        self._dead: set[str] = set()
        self._dead_lock = threading.Lock()
        self._keys: Mapping[str, str] | None = None  # the topology's member -> public key
        self._keys_epoch = -1
        # frames of a later epoch than the keys' (member, key, epoch, parts), and frames
        # vouched for by a newer topology, handed out before the socket's
        self._held: deque[tuple[str, str, int, list[zmq.Frame]]] = deque()
        self._replay: deque[list[zmq.Frame]] = deque()
        self._warned: set[tuple[str, str | None]] = set()

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

        Links that stay (same peer, same address) keep their socket unless their connection
        dropped and was made again (see :attr:`Link.reconnected`); the others are closed
        (``on_close(peer)`` is called just before) and the new ones opened, in peer order.
        """
        self.drain_monitors()
        gone = [p for p, link in self._links.items()
                if wanted.get(p) != link.address or link.reconnected]  # fmt: skip
        for peer in gone:
            on_close(peer)
            self._close_link(self._links.pop(peer))
        for peer, address in sorted(wanted.items()):
            if peer not in self._links:
                self._links[peer] = self._open_link(peer, address)

    def renew_lost(self, on_close: Callable[[str], None]) -> list[str]:
        """Replaces every link whose connection dropped and was made again with a new socket
        (a fresh routing id) to the same address; call it before a round, so that no frame of
        the round goes out under an id the neighbour may still hold for a connection that is
        gone (:attr:`Link.reconnected`). A link still down is kept: the round fails on it.

        Returns:
            The peers whose link was replaced.
        """
        self.drain_monitors()
        lost = [p for p, link in self._links.items() if link.reconnected]
        for peer in lost:
            on_close(peer)
            old = self._links[peer]
            self._close_link(old, flush_s=0.0)
            self._links[peer] = self._open_link(peer, old.address)
        if lost:
            self._stats.links_renewed += len(lost)
        return lost

    def _open_link(self, peer: str, address: str) -> Link:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self._config.node_id))
        sock.setsockopt(zmq.LINGER, 0)
        keep_alive(sock)
        sock.setsockopt(zmq.SNDHWM, self._config.sndhwm)
        if self._config.sock_buf_bytes:
            sock.setsockopt(zmq.SNDBUF, self._config.sock_buf_bytes)
        self.security.client(sock)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(address)
        self.poller.register(monitor, zmq.POLLIN)
        return Link(peer, address, sock, monitor)

    def _close_link(self, link: Link, flush_s: float = FLUSH_ON_CLOSE_S) -> None:
        self.poller.unregister(link.monitor)
        link.socket.disable_monitor()
        link.monitor.close(linger=0)
        link.socket.close(linger=int(flush_s * 1000))

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
            if link.refused is not None:
                raise PeerFailure(
                    link.peer, f"CURVE handshake failed ({link.refused}): {_NO_KEY}",
                    reported_by=me,
                )  # fmt: skip

    def drain_monitors(self, events: Mapping[object, int] | None = None) -> None:
        """Applies the monitors' connection events (only the links in ``events``, if given)."""
        for link in self._links.values():
            if events is None or link.monitor in events:
                self._drain_monitor(link)
        watch = self._handshakes
        if watch is not None and (events is None or watch.monitor in events):
            watch.drain()

    def _drain_monitor(self, link: Link) -> None:
        while link.monitor.poll(0):
            event = recv_monitor_message(link.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.reconnected = link.lost  # lost stays: the id is stale (Link.reconnected)
                link.connected, link.refused = True, None
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                link.lost = True
            elif (error := handshake_error(event)) is not None:
                self._stats.handshake_failures += 1
                if link.refused is None:
                    log.warning(
                        "%s: cannot connect to %s at %s: CURVE handshake failed (%s): %s",
                        self._config.node_id, link.peer, link.address, error, _NO_KEY,
                    )  # fmt: skip
                link.refused = error

    def _count_refusal(self, _refusal: HandshakeRefusal) -> None:
        """Counts a connection the data endpoint refused in the CURVE handshake."""
        self._stats.handshake_failures += 1

    def _log_refusal(self, refusal: HandshakeRefusal) -> None:
        """Logs one of the first refusals of the data endpoint. The monitor names only this
        node's endpoint, not the stranger's."""
        log.warning(
            "%s: refused a connection to the data endpoint %s: CURVE handshake failed "
            "(%s): the peer has no or a different cluster key%s", self._config.node_id,
            self.address, refusal.detail,
            "" if refusal.count < _REFUSALS_LOGGED else " (further refusals are only counted)",
        )  # fmt: skip

    # ------------------------------------------------------------------ member keys

    def vouch(self, keys: Mapping[str, str] | None, epoch: int) -> None:
        """Takes the members' public keys of the topology of ``epoch`` (``None``: accept every
        frame); the held frames they vouch for are handed out next, those they refute are
        dropped."""
        self._keys, self._keys_epoch = keys, epoch
        held, self._held = self._held, deque()
        for member, key, frame_epoch, parts in held:
            if keys is None or keys.get(member) == key:
                self._budget.release(parts_bytes(parts))
                self._replay.append(parts)
            elif frame_epoch > epoch:
                self._held.append((member, key, frame_epoch, parts))
            else:
                self._budget.release(parts_bytes(parts))
                self._refute(member, key)

    def _vouched(self, parts: list[zmq.Frame]) -> bool:
        """Whether a message comes from the member it claims to (see the module docstring);
        a frame of a later epoch is held for that epoch's keys."""
        keys = self._keys
        if keys is None:
            return True
        try:
            member = member_of(parts[0].bytes)
        except UnicodeDecodeError:
            member = repr(parts[0].bytes)
        key = authenticated_key(parts[-1])
        if key is not None and keys.get(member) == key:
            return True
        epoch = _epoch_of(parts)
        if key is not None and epoch is not None and epoch > self._keys_epoch:
            if self._budget.admit(epoch, parts_bytes(parts), len(self._held), member):
                self._held.append((member, key, epoch, parts))
            return False
        self._refute(member, key)
        return False

    def _refute(self, member: str, key: str | None) -> None:
        self._stats.dropped_unauthenticated += 1
        if (member, key) not in self._warned and len(self._warned) < 64:
            self._warned.add((member, key))
            log.warning(
                "%s: dropped a frame that claims to come from %r over a connection with "
                "another key (%s): a key holder sending as another member", self._config.node_id,
                member, key,
            )  # fmt: skip

    # ------------------------------------------------------------------ receiving

    def recv_nowait(self) -> list[zmq.Frame]:
        """The next message on the data endpoint, without waiting (with member keys: the next
        one from the member it claims to come from).

        Raises:
            zmq.Again: none is queued.
        """
        while True:
            if self._replay:
                return self._replay.popleft()
            parts = self._router.recv_multipart(_NOBLOCK, copy=False)
            if self._vouched(parts):
                return parts

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
            self._close_link(link, flush_s=0.0)  # closing for good: nothing waits on it
        self._links.clear()

    def close(self) -> None:
        """Closes the endpoint and terminates the context (close every other socket first)."""
        self._budget.release(sum(parts_bytes(parts) for *_, parts in self._held))
        self._held.clear()
        self._replay.clear()
        self._close_router()

    def _close_router(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
        self._router.close(linger=0)
        self.security.release(self.ctx)
        self.ctx.term()


def _epoch_of(parts: list[zmq.Frame]) -> int | None:
    """The epoch a data-endpoint message's header names (``None``: not a well-formed one)."""
    if len(parts) != 3:
        return None
    try:
        return decode_header(parts[1].buffer).epoch
    except ProtocolError:
        return None
