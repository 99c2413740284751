"""Payload lanes: plain TCP connections that carry tensor chunks beside ZeroMQ.

ZeroMQ receives every message into a buffer it allocates, on its own I/O thread. For the
allreduce's chunks that costs a copy out of that buffer into the result and a thread hop on both
ends, which on a loaded host is most of the gap to gloo. A lane is one plain TCP connection per
direction of a link that carries only data frames (the 32-byte header of
:mod:`chaos.collectives.frames`, then the payload), so the receiver reads each payload straight
into its destination (the result buffer, see :meth:`Communicator.recv
<chaos.collectives.communicator.Communicator.recv>`'s ``place``) and a sender thread writes it
straight from the tensor. Everything else (aborts, notices, results for a neighbour a step behind)
stays on ZeroMQ, and so does failure detection: a lane that breaks is closed quietly and its
traffic falls back to ZeroMQ.

Lanes are for large tensors only (``CommunicatorConfig.lane_min_bytes``): a communicator opens
its listener at its first round of such a tensor. Set-up, per link, by the receiver: at such a
round it sends its neighbour, over ZeroMQ, an offer (``Op.LANE``) with its lane port and a random
token (again at later rounds until the lane is up). The neighbour's :class:`OutLane` thread
connects to that port and sends a hello with its node id and the token; the receiver's
:class:`Lanes` accepts it only with the token of the current link. Until the hello has gone out,
the sender keeps using ZeroMQ; mixing the two within a round is harmless, since every frame names
its round, segment and chunk.

Hello (little-endian): ``b"CHLN"``, u8 :data:`LANE_VERSION`, u64 token, u8 id length, the id
(utf-8), answered by the one byte :data:`_ACK` once accepted (the sender uses the lane only
then, so no frame is written into a connection the receiver refuses). Offer payload: u16 port,
u64 token.
"""

from __future__ import annotations

import _thread
import logging
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from chaos.collectives.frames import DATA_OPS, HEADER_BYTES, Header, decode_header
from chaos.collectives.links import Frame, LanePayload
from chaos.errors import PeerTimeout, ProtocolError
from chaos.wire import LANE_HELLO as _HELLO
from chaos.wire import LANE_MAGIC as _MAGIC
from chaos.wire import LANE_OFFER as _OFFER
from chaos.wire import LANE_VERSION

__all__ = [
    "LANE_VERSION", "InLane", "Lanes", "OutLane", "Place", "decode_offer", "encode_offer",
    "endpoint_host", "open_lanes", "read_frame", "resend",
]

Place = Callable[[str, Header], "memoryview | None"]
"""Where a lane frame's payload goes: a writable region of the round's result buffer, or
``None`` for a buffer of its own (see ``Communicator.recv``)."""

log = logging.getLogger("chaos.collectives")

_ACK = b"\x01"
_MAX_ID = 255
_PENDING_LIMIT = 64
"""Accepted connections still owing their hello; beyond this the oldest is dropped."""


def encode_offer(port: int, token: int) -> bytes:
    """The payload of an ``Op.LANE`` offer."""
    return _OFFER.pack(port, token)


def decode_offer(raw: bytes | memoryview) -> tuple[int, int]:
    """``(port, token)`` of an offer.

    Raises:
        ProtocolError: wrong size or port 0.
    """
    if len(raw) != _OFFER.size:
        raise ProtocolError(f"lane offer is {len(raw)} bytes, expected {_OFFER.size}")
    port, token = _OFFER.unpack(raw)
    if port == 0:
        raise ProtocolError("lane offer names port 0")
    return int(port), int(token)


def encode_hello(node_id: str, token: int) -> bytes:
    """The first bytes an :class:`OutLane` sends.

    Raises:
        ValueError: the node id is longer than 255 bytes.
    """
    raw = node_id.encode()
    if not 0 < len(raw) <= _MAX_ID:
        raise ValueError("a lane hello needs a node id of 1 to 255 bytes")
    return _HELLO.pack(_MAGIC, LANE_VERSION, token, len(raw)) + raw


def _set_timeo(sock: socket.socket, option: int, seconds: float) -> None:
    """Kernel send/receive timeout of a blocking socket (``SO_SNDTIMEO``/``SO_RCVTIMEO``)."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1  # zero would mean "no timeout"
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, usec))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class OutLane:
    """The sending end of a lane: a connection to a neighbour and the thread that writes to it.

    Frames are queued by :meth:`put` and written in order by the lane's thread, straight from
    the caller's buffers; the caller keeps those buffers unchanged until :meth:`drain` says they
    are written (as with ZeroMQ's zero-copy sends). A lane that fails (refused, reset, closed by
    the receiver) is marked dead; the frames it had not fully written stay queued for
    :meth:`take_unsent`, so that the caller sends them through ZeroMQ instead.

    Args:
        peer: The neighbour's node id.
        host: The neighbour's host (from its data endpoint).
        port: Its lane port, from the offer.
        token: The offer's token, echoed in the hello.
        node_id: This node's id.
        connect_timeout_s: Longest wait for the connection.
        slice_s: Longest single blocking write; the thread checks for :meth:`close` between
            slices, so a write to a stuck neighbour never blocks forever.
    """

    def __init__(self, peer: str, host: str, port: int, token: int, node_id: str,
                 connect_timeout_s: float, slice_s: float) -> None:  # fmt: skip
        self.peer = peer
        self.port = port
        self.token = token
        self._address = (host, port)
        self._hello = encode_hello(node_id, token)
        self._connect_timeout_s = connect_timeout_s
        self._slice_s = slice_s
        self._cv = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview, Any]] = deque()
        self._queued = 0
        self._done = 0
        self._inflight: tuple[bytes, memoryview, Any] | None = None
        self._ready = False
        self._dead = False
        self._closing = False
        self._sock: socket.socket | None = None
        # A low-level thread: threading.Thread.start() waits until the new thread is scheduled,
        # which on a loaded host takes milliseconds (p90 5 ms with two cores and four busy
        # processes) in the middle of a training step; this returns at once.
        _thread.start_new_thread(self._run, ())

    @property
    def ready(self) -> bool:
        """Connected and greeted: frames put now go over the lane."""
        return self._ready and not self._dead

    @property
    def dead(self) -> bool:
        """Failed or closed; a new offer replaces it."""
        return self._dead

    def put(self, header: bytes, payload: memoryview, keep: Any = None) -> bool:
        """Queues one frame; ``keep`` is held until it is written (e.g. the ZeroMQ frame whose
        memory ``payload`` is).

        Returns:
            ``False`` when the lane is not usable (not ready yet, or dead): send elsewhere.
        """
        with self._cv:
            if not self._ready or self._dead:
                return False
            self._queue.append((header, payload, keep))
            self._queued += 1
            self._cv.notify_all()
        return True

    def drain(self, timeout_s: float) -> bool:
        """Waits until every queued frame is written to the kernel (or the lane died).

        Returns:
            ``False`` if frames were still unwritten after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._done < self._queued and not self._dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def take_unsent(self) -> list[tuple[bytes, memoryview, Any]]:
        """The frames a dead lane did not fully write, in order (empties the queue)."""
        with self._cv:
            if not self._dead:
                return []
            items = list(self._queue)
            self._queue.clear()
            return items

    def cancel(self, timeout_s: float) -> None:
        """Drops the frames not yet started and waits for the one being written; a lane whose
        write does not finish within ``timeout_s`` is closed (the stream is cut mid-frame, which
        the receiver sees as a lost connection)."""
        with self._cv:
            self._queued -= len(self._queue)
            self._queue.clear()
        if not self.drain(timeout_s):
            self.close()

    def close(self) -> None:
        """Stops the thread and closes the connection; idempotent."""
        with self._cv:
            self._closing = True
            self._dead = True
            self._queue.clear()
            sock = self._sock
            self._cv.notify_all()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout_s)
            sock.settimeout(None)
            _tune(sock)
            _set_timeo(sock, socket.SO_SNDTIMEO, self._slice_s)
            with self._cv:
                if self._closing:
                    return
                self._sock = sock
            self._write(sock, [memoryview(self._hello)])
            self._await_ack(sock)
            with self._cv:
                self._ready = not self._closing
            while True:
                with self._cv:
                    while not self._queue and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return
                    self._inflight = item = self._queue.popleft()
                if _closed_by_peer(sock):
                    raise OSError("the receiver closed the lane")
                self._write(sock, [memoryview(item[0]), item[1]])
                with self._cv:
                    self._inflight = None
                    self._done += 1
                    self._cv.notify_all()
        except (OSError, _Closed) as exc:
            if not self._closing:
                log.debug("lane to %s failed: %s", self.peer, exc)
        finally:
            with self._cv:
                self._dead = True
                if self._inflight is not None and not self._closing:
                    self._queue.appendleft(self._inflight)  # not fully written: send it again
                self._inflight = None
                self._cv.notify_all()
            if sock is not None:
                sock.close()

    def _await_ack(self, sock: socket.socket) -> None:
        """Waits (up to the connect timeout) for the receiver to accept the hello.

        Raises:
            OSError: refused (closed), or no answer in time.
        """
        _set_timeo(sock, socket.SO_RCVTIMEO, self._connect_timeout_s)
        if sock.recv(1) != _ACK:
            raise OSError("the receiver refused the lane")

    def _write(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Writes all of ``views``, in slices of at most ``slice_s`` blocking each.

        Raises:
            OSError: the connection failed.
            _Closed: :meth:`close` was called meanwhile.
        """
        views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        while views:
            try:
                n = sock.sendmsg(views)
            except BlockingIOError:  # nothing went out within the slice
                n = 0
            if self._closing:
                raise _Closed
            while n and views:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0] = views[0][n:]
                    n = 0


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the receiver closed the connection (it never sends on a lane)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Closed(Exception):
    """Internal: the lane was closed while its thread was writing."""


class InLane:
    """The receiving end of a lane: an accepted, greeted connection from a neighbour.

    A read blocks in the kernel (one ``recv`` with ``MSG_WAITALL`` per payload, as long as the
    bytes keep coming), in slices of at most the time given to :meth:`set_timeout`.
    """

    def __init__(self, peer: str, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self._timeout_s = -1.0

    def fileno(self) -> int:
        return self.sock.fileno()

    def set_timeout(self, timeout_s: float) -> None:
        """The longest single blocking wait of a read (set on the socket when it changes)."""
        if timeout_s != self._timeout_s:
            _set_timeo(self.sock, socket.SO_RCVTIMEO, timeout_s)
            self._timeout_s = timeout_s

    def read_into(
        self, view: memoryview, deadline: float, between: Callable[[], None]
    ) -> str | None:
        """Fills ``view`` from the stream.

        Args:
            view: Where the bytes go.
            deadline: ``time.monotonic()`` after which a wait for bytes gives up.
            between: Called whenever a slice passes with no bytes (it may raise, e.g. when the
                peer is reported dead meanwhile).

        Returns:
            ``None`` when filled, ``"closed"`` at the end of the stream (the peer closed or
            died), ``"timeout"`` when the bytes did not come by the deadline.
        """
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        got, n = 0, len(view)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return "timeout"
                between()
                continue
            except OSError:
                return "closed"
            if k == 0:
                return "closed"
            got += k
        return None

    def close(self) -> None:
        self.sock.close()


def endpoint_host(address: str) -> str:
    """``HOST`` of ``tcp://HOST:PORT`` (brackets of an IPv6 address removed)."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def open_lanes(node_id: str, address: str, timeout_s: float, slice_s: float) -> Lanes | None:
    """The payload lanes of a communicator bound at ``address`` (its host), or ``None`` where
    lanes cannot be had (not a ``tcp://`` endpoint, or the listener cannot be bound)."""
    if not address.startswith("tcp://"):
        return None
    try:
        return Lanes(node_id, endpoint_host(address), timeout_s, slice_s)
    except OSError as exc:
        log.warning("no payload lanes (%s): tensor chunks go through ZeroMQ", exc)
        return None


def resend(sock: zmq.Socket, peer: str, frames: list[tuple[bytes, memoryview, Any]]) -> None:
    """Sends through ZeroMQ (copied: the round may end before they leave) the frames a lane
    that died did not write.

    Raises:
        PeerTimeout: the link's queue is full.
    """
    try:
        for header, payload, _keep in frames:
            sock.send(header, zmq.SNDMORE | zmq.NOBLOCK, copy=True)
            sock.send(payload, zmq.NOBLOCK, copy=True)
    except zmq.Again:
        raise PeerTimeout(peer, "send queue full") from None


def read_frame(
    lane: InLane,
    key: tuple[int, int],
    deadline: float,
    slice_s: float,
    place: Place | None,
    max_bytes: int,
    between: Callable[[], None],
) -> Frame | str:
    """Reads one data frame from a readable lane.

    Args:
        lane: The lane.
        key: The running round's ``(epoch, step)``: only its frames are ``place``d.
        deadline: ``time.monotonic()`` by which the frame must be complete.
        slice_s: Longest single blocking wait; ``between`` runs after each empty one.
        place: Names the payload's destination (see :data:`Place`); otherwise the payload gets
            a buffer of its own.
        max_bytes: Largest payload accepted (the chunk size).
        between: The checks to make between slices (they may raise; the caller then closes
            the lane, whose stream is cut mid-frame).

    Returns:
        The frame, or why there is none: ``"closed"`` (the stream ended), ``"timeout"`` (it
        stopped in the middle of a frame) or ``"malformed: ..."`` (a bad header: the stream
        cannot be trusted any more). The caller closes the lane in every case but a frame.
    """
    lane.set_timeout(slice_s)
    raw = bytearray(HEADER_BYTES)
    status = lane.read_into(memoryview(raw), deadline, between)
    if status is not None:
        return status
    try:
        header = decode_header(memoryview(raw))
        nbytes = header.nelem * header.dtype.itemsize
        if header.op not in DATA_OPS or nbytes > max_bytes:
            raise ProtocolError(f"{header.op.name} frame of {nbytes} bytes on a lane")
    except ProtocolError as exc:
        return f"malformed: {exc}"
    dest = place(lane.peer, header) if place is not None and header.key == key else None
    buf = dest if dest is not None else torch.empty(nbytes, dtype=torch.uint8).numpy().data
    status = lane.read_into(buf, deadline, between)
    if status is not None:
        return status
    return Frame(lane.peer, header, bytes(raw), LanePayload(buf), placed=dest is not None)


@dataclass(eq=False)
class _Pending:
    """An accepted connection that has not finished its hello."""

    sock: socket.socket
    since: float
    data: bytearray = field(default_factory=bytearray)

    def fileno(self) -> int:
        return self.sock.fileno()


class Lanes:
    """One node's lanes: the listener, the incoming lanes by peer, the outgoing ones by peer.

    Not thread-safe; the communicator's thread calls everything (the :class:`OutLane` threads
    only write). Sockets to poll are handed out by :meth:`poll_sockets`; :meth:`on_readable`
    takes the ones the poll reported.

    Args:
        node_id: This node's id.
        host: The host to listen on (the host of the ZeroMQ data endpoint).
        connect_timeout_s: See :class:`OutLane`.
        slice_s: See :class:`OutLane`.

    Raises:
        OSError: the listener cannot be bound.
    """

    def __init__(self, node_id: str, host: str, connect_timeout_s: float, slice_s: float) -> None:
        self.node_id = node_id
        self._connect_timeout_s = connect_timeout_s
        self._slice_s = slice_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(16)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._tokens: dict[str, int] = {}  # peer -> token of this node's current offer
        self.incoming: dict[str, InLane] = {}
        self.outgoing: dict[str, OutLane] = {}
        self._pending: list[_Pending] = []
        self._polled: set[Any] = set()
        self.rejected = 0
        """Connections refused: a bad or late hello, an unknown peer or token."""

    # ------------------------------------------------------------------ offers

    def offer(self, peer: str) -> bytes:
        """The offer payload for ``peer`` (a fresh token the first time after :meth:`drop`)."""
        token = self._tokens.get(peer)
        if token is None:
            token = self._tokens[peer] = secrets.randbits(64)
        return encode_offer(self.port, token)

    def wants_offer(self, peer: str) -> bool:
        """No incoming lane from ``peer`` yet: offer again."""
        return peer not in self.incoming

    def on_offer(self, peer: str, host: str, raw: bytes | memoryview) -> None:
        """A neighbour's offer: opens (or replaces) the outgoing lane to it.

        Raises:
            ProtocolError: a malformed offer.
        """
        port, token = decode_offer(raw)
        old = self.outgoing.get(peer)
        if old is not None and not old.dead and (old.port, old.token) == (port, token):
            return
        if old is not None:
            old.close()
        self.outgoing[peer] = OutLane(peer, host, port, token, self.node_id,
                                      self._connect_timeout_s, self._slice_s)  # fmt: skip

    # ------------------------------------------------------------------ polling

    def poll_sockets(self) -> Iterator[Any]:
        """The listener, the connections owing a hello and the incoming lanes (poll for input)."""
        yield self._listener
        yield from self._pending
        yield from self.incoming.values()

    def sync_poller(self, poller: zmq.Poller) -> None:
        """Registers :meth:`poll_sockets` with ``poller`` (and unregisters the closed ones)."""
        want = set(self.poll_sockets())
        for item in self._polled - want:
            poller.unregister(item)
        for item in want - self._polled:
            poller.register(item, zmq.POLLIN)
        self._polled = want

    def on_readable(self, ready: set[int]) -> InLane | None:
        """Accepts and greets what the poll reported (file descriptors); returns a readable
        incoming lane."""
        # lanes greeted below reuse the fd their hello was polled on: not readable for data
        readable = [lane for lane in self.incoming.values() if lane.fileno() in ready]
        if self._listener.fileno() in ready:
            self._accept()
        for pending in [p for p in self._pending if p.fileno() in ready]:
            self._greet(pending)
        now = time.monotonic()
        for pending in [p for p in self._pending if now - p.since > self._connect_timeout_s]:
            self._refuse(pending)
        return readable[0] if readable else None

    def _accept(self) -> None:
        while True:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            self._pending.append(_Pending(sock, time.monotonic()))
            if len(self._pending) > _PENDING_LIMIT:
                self._refuse(self._pending[0])

    def _greet(self, pending: _Pending) -> None:
        """Reads the hello (exactly its bytes: data frames may follow at once)."""
        data = pending.data
        if len(data) < _HELLO.size:
            need = _HELLO.size - len(data)
        else:
            magic, version, _token, n = _HELLO.unpack_from(data)
            need = _HELLO.size + n - len(data)
        try:
            chunk = pending.sock.recv(need)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._refuse(pending)
            return
        data += chunk
        if len(data) < _HELLO.size:
            return
        magic, version, token, n = _HELLO.unpack_from(data)
        if magic != _MAGIC or version != LANE_VERSION or n == 0:
            self._refuse(pending)
            return
        if len(data) < _HELLO.size + n:
            return
        try:
            peer = bytes(data[_HELLO.size:]).decode()
        except UnicodeDecodeError:
            peer = ""
        if self._tokens.get(peer) != token:
            self._refuse(pending)  # not the current offer of a link
            return
        self._pending.remove(pending)
        sock = pending.sock
        try:
            sock.send(_ACK)
        except OSError:
            pending.sock.close()
            return
        sock.setblocking(True)
        _tune(sock)
        old = self.incoming.pop(peer, None)
        if old is not None:
            old.close()
        self.incoming[peer] = InLane(peer, sock)

    def _refuse(self, pending: _Pending) -> None:
        self.rejected += 1
        if pending in self._pending:
            self._pending.remove(pending)
        pending.sock.close()

    # ------------------------------------------------------------------ teardown

    def close_incoming(self, peer: str) -> None:
        """Closes the incoming lane from ``peer`` (its stream can no longer be trusted); the
        next offer has a new token, so the neighbour replaces its end and connects again."""
        lane = self.incoming.pop(peer, None)
        if lane is not None:
            lane.close()
            self._tokens.pop(peer, None)

    def drop(self, peer: str) -> None:
        """Forgets ``peer`` (its link closed): both lanes and the offer's token."""
        self.close_incoming(peer)
        self._tokens.pop(peer, None)
        out = self.outgoing.pop(peer, None)
        if out is not None:
            out.close()

    def send(
        self, sock: zmq.Socket, peer: str, header: bytes, payload: memoryview | Any
    ) -> bool:
        """Queues a data frame on the lane to ``peer`` (a ZeroMQ frame or a
        :class:`LanePayload` is sent from its buffer and kept until written).

        The frames a dead lane did not write go out through ``sock`` (the link's ZeroMQ
        socket) first.

        Returns:
            ``False`` when there is no usable lane: send the frame through ZeroMQ.

        Raises:
            PeerTimeout: resending through ZeroMQ found the link's queue full.
        """
        lane = self.outgoing.get(peer)
        if lane is None:
            return False
        if lane.dead:
            resend(sock, peer, lane.take_unsent())
        view = payload if isinstance(payload, memoryview) else payload.buffer
        return lane.put(header, view, payload)

    def resend_dead(self, sock_of: Callable[[str], zmq.Socket | None]) -> None:
        """Sends through ZeroMQ (``sock_of(peer)``: the link's socket) the frames that lanes
        which died did not write, so that a round never waits on them.

        Raises:
            PeerTimeout: a link's queue is full.
        """
        for peer, lane in self.outgoing.items():
            if lane.dead:
                sock = sock_of(peer)
                if sock is not None:
                    resend(sock, peer, lane.take_unsent())

    def drain(
        self, timeout_s: float, sock_of: Callable[[str], zmq.Socket | None]
    ) -> str | None:
        """Waits until every outgoing lane has written its queue; the frames of a lane that
        died meanwhile are sent through its link's ZeroMQ socket (see :meth:`resend_dead`).

        Returns:
            A neighbour whose frames were still unwritten after ``timeout_s``, or ``None``.

        Raises:
            PeerTimeout: resending through ZeroMQ found a link's queue full.
        """
        deadline = time.monotonic() + timeout_s
        for peer, lane in self.outgoing.items():
            if not lane.drain(max(0.0, deadline - time.monotonic())):
                return peer
        self.resend_dead(sock_of)
        return None

    def cancel(self, timeout_s: float) -> None:
        """Drops every outgoing lane's unsent frames (after a failed round)."""
        for lane in self.outgoing.values():
            lane.cancel(timeout_s)

    def close(self) -> None:
        """Closes every lane and the listener; idempotent."""
        for peer in list(self._tokens.keys() | self.incoming.keys() | self.outgoing.keys()):
            self.drop(peer)
        for pending in list(self._pending):
            self._refuse(pending)
        self._listener.close()
