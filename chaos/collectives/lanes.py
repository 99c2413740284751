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

The modules beside this one each have one job: :mod:`~chaos.collectives.lane_wire` (offers,
hellos and the format of a sealed lane), :mod:`~chaos.collectives.lane_crypto` (AES-GCM records
and the workers that seal them), :mod:`~chaos.collectives.lane_out` (the sending end) and
:mod:`~chaos.collectives.lane_in` (the receiving end). This module is the facade the
communicator uses: the listener, the greeting of hellos and the lanes by peer.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from chaos.collectives.lane_crypto import (
    LANE_KEY_BYTES,
    MAX_ATTEMPT,
    TAG_BYTES,
    TO_RECEIVER,
    TO_SENDER,
    LaneCipher,
)
from chaos.collectives.lane_in import InLane, Place, read_frame
from chaos.collectives.lane_out import OutLane, resend
from chaos.collectives.lane_wire import (
    ACK,
    MAX_ID,
    MAX_SEALED_BODY,
    decode_offer,
    decode_sealed_offer,
    encode_hello,
    encode_offer,
    encode_sealed_hello,
    encode_sealed_offer,
    tune_socket,
)
from chaos.wire import LANE_HELLO as _HELLO
from chaos.wire import LANE_HELLO_BODY as _HELLO_BODY
from chaos.wire import LANE_MAGIC as _MAGIC
from chaos.wire import LANE_SEALED_HELLO as _SEALED_HELLO
from chaos.wire import LANE_SEALED_MAGIC as _SEALED_MAGIC
from chaos.wire import LANE_VERSION

__all__ = [
    "LANE_KEY_BYTES", "LANE_VERSION", "InLane", "LaneCipher", "Lanes", "OutLane", "Place",
    "decode_offer", "decode_sealed_offer", "encode_hello", "encode_offer", "encode_sealed_hello",
    "encode_sealed_offer", "endpoint_host", "open_lanes", "read_frame", "resend",
]  # fmt: skip

log = logging.getLogger("chaos.collectives")

_PENDING_LIMIT = 64
"""Accepted connections still owing their hello; beyond this the oldest is dropped."""


@dataclass
class _Offer:
    """This node's current offer to one neighbour: the token, the lane key of a sealed lane,
    and the newest attempt of that key accepted (a hello must name a newer one)."""

    token: int
    key: bytes | None
    accepted: int = -1


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
        sealed: AES-256-GCM lanes: offers carry a fresh key, hellos and frames are sealed with
            it (see the module docstring); plain hellos are refused.

    Raises:
        OSError: the listener cannot be bound.
    """

    def __init__(self, node_id: str, host: str, connect_timeout_s: float, slice_s: float,
                 sealed: bool = False) -> None:  # fmt: skip
        self.node_id = node_id
        self.sealed = sealed
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
        self._offers: dict[str, _Offer] = {}  # peer -> this node's current offer to it
        # peer -> (port, token, attempt) of the last sealed offer this node connected to: a
        # new connection to the same offer takes the next attempt (a fresh nonce space)
        self._attempts: dict[str, tuple[int, int, int]] = {}
        self.incoming: dict[str, InLane] = {}
        self.outgoing: dict[str, OutLane] = {}
        self._pending: list[_Pending] = []
        self._polled: set[Any] = set()
        self.rejected = 0
        """Connections refused: a bad or late hello, an unknown peer or token."""

    # ------------------------------------------------------------------ offers

    def offer(self, peer: str) -> bytes:
        """The offer payload for ``peer`` (a fresh token, and key when sealed, the first time
        after :meth:`drop` or :meth:`close_incoming`)."""
        offer = self._offers.get(peer)
        if offer is None:
            key = secrets.token_bytes(LANE_KEY_BYTES) if self.sealed else None
            offer = self._offers[peer] = _Offer(secrets.randbits(64), key)
        if offer.key is None:
            return encode_offer(self.port, offer.token)
        return encode_sealed_offer(self.port, offer.token, offer.key)

    def wants_offer(self, peer: str) -> bool:
        """No incoming lane from ``peer`` yet: offer again."""
        return peer not in self.incoming

    def on_offer(self, peer: str, host: str, raw: bytes | memoryview) -> None:
        """A neighbour's offer: opens (or replaces) the outgoing lane to it.

        Raises:
            ProtocolError: a malformed offer.
        """
        key: bytes | None = None
        if self.sealed:
            port, token, key = decode_sealed_offer(raw)
        else:
            port, token = decode_offer(raw)
        old = self.outgoing.get(peer)
        if old is not None and not old.dead and (old.port, old.token) == (port, token):
            return
        last = self._attempts.get(peer)
        attempt = last[2] + 1 if last is not None and last[:2] == (port, token) else 0
        if attempt > MAX_ATTEMPT:
            return  # this offer was tried too often: ZeroMQ carries the frames
        if old is not None:
            old.close()
        self._attempts[peer] = (port, token, attempt)
        self.outgoing[peer] = OutLane(peer, host, port, token, self.node_id,
                                      self._connect_timeout_s, self._slice_s, key,
                                      attempt)  # fmt: skip

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
        """Reads the hello (exactly its bytes: data frames may follow at once) and accepts the
        lane when it answers a current offer; refuses it otherwise."""
        prefix = _SEALED_HELLO if self.sealed else _HELLO
        data = pending.data
        if len(data) < prefix.size:
            need = prefix.size - len(data)
        else:
            need = prefix.size + prefix.unpack_from(data)[-1] - len(data)
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
        if len(data) < prefix.size:
            return
        magic, version, _field, n = prefix.unpack_from(data)
        lo, hi = (_HELLO_BODY.size + 1 + TAG_BYTES, MAX_SEALED_BODY) if self.sealed else (1, MAX_ID)
        if (
            magic != (_SEALED_MAGIC if self.sealed else _MAGIC)
            or version != LANE_VERSION
            or not (lo <= n <= hi)
        ):
            self._refuse(pending)  # not a hello of this lane version and mode
            return
        if len(data) < prefix.size + n:
            return
        found = self._open_hello(bytes(data)) if self.sealed else self._plain_hello(bytes(data))
        if found is None:
            self._refuse(pending)  # not the current offer of a link
            return
        peer, ack, cipher = found
        self._pending.remove(pending)
        sock = pending.sock
        try:
            sock.send(ack)
        except OSError:
            pending.sock.close()
            return
        sock.setblocking(True)
        tune_socket(sock)
        old = self.incoming.pop(peer, None)
        if old is not None:
            old.close()
        self.incoming[peer] = InLane(peer, sock, cipher)

    def _plain_hello(self, data: bytes) -> tuple[str, bytes, None] | None:
        """``(peer, ack, None)`` when a plain hello names a peer and its current token."""
        _magic, _version, token, _n = _HELLO.unpack_from(data)
        try:
            peer = data[_HELLO.size :].decode()
        except UnicodeDecodeError:
            return None
        offer = self._offers.get(peer)
        if offer is None or offer.key is not None or offer.token != token:
            return None
        return peer, ACK, None

    def _open_hello(self, data: bytes) -> tuple[str, bytes, LaneCipher] | None:
        """``(peer, sealed ack, the lane's cipher)`` when a sealed hello opens with the key of a
        current offer, names that offer's peer and token, and a newer attempt than any that
        key was accepted with (a replayed hello names an old one)."""
        prefix = data[: _SEALED_HELLO.size]
        _magic, _version, attempt, _n = _SEALED_HELLO.unpack(prefix)
        if attempt > MAX_ATTEMPT:
            return None
        for peer, offer in self._offers.items():
            if offer.key is None or attempt <= offer.accepted:
                continue
            cipher = LaneCipher(offer.key, attempt, TO_RECEIVER)
            body = cipher.open(data[_SEALED_HELLO.size :], prefix)
            if body is None or len(body) < _HELLO_BODY.size:
                continue
            token, n = _HELLO_BODY.unpack_from(body)
            if (
                token != offer.token
                or body[_HELLO_BODY.size :] != peer.encode()
                or n != len(body) - _HELLO_BODY.size
            ):
                return None  # sealed with the key, yet not what the offer said: refuse
            offer.accepted = attempt
            ack = LaneCipher(offer.key, attempt, TO_SENDER).seal(ACK)
            return peer, ack, cipher
        return None

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
            self._offers.pop(peer, None)

    def drop(self, peer: str) -> None:
        """Forgets ``peer`` (its link closed): both lanes and the offer's token."""
        self.close_incoming(peer)
        self._offers.pop(peer, None)
        out = self.outgoing.pop(peer, None)
        if out is not None:
            out.close()

    def send(self, sock: zmq.Socket, peer: str, header: bytes, payload: memoryview | Any) -> bool:
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

    def drain(self, timeout_s: float, sock_of: Callable[[str], zmq.Socket | None]) -> str | None:
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
        for peer in list(self._offers.keys() | self.incoming.keys() | self.outgoing.keys()):
            self.drop(peer)
        for pending in list(self._pending):
            self._refuse(pending)
        self._listener.close()


def endpoint_host(address: str) -> str:
    """``HOST`` of ``tcp://HOST:PORT`` (brackets of an IPv6 address removed)."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def open_lanes(
    node_id: str, address: str, timeout_s: float, slice_s: float, sealed: bool = False
) -> Lanes | None:
    """The payload lanes of a communicator bound at ``address`` (its host), or ``None`` where
    lanes cannot be had (not a ``tcp://`` endpoint, or the listener cannot be bound).
    ``sealed``: AES-256-GCM lanes (a communicator with a cluster key)."""
    if not address.startswith("tcp://"):
        return None
    try:
        return Lanes(node_id, endpoint_host(address), timeout_s, slice_s, sealed=sealed)
    except OSError as exc:
        log.warning("no payload lanes (%s): tensor chunks go through ZeroMQ", exc)
        return None
