"""ZeroMQ transport: a ROUTER on TCP for peers, a ROUTER on IPC for the local CLI and trainer,
and one DEALER per known peer; plus the named :class:`FaultInjector`.

Replies go back on the socket a message came in on (to its routing envelope); messages a node
starts go out on its DEALER to that peer. Both ROUTERs accept plain DEALER clients
(``[id, payload]``) and REQ clients (``[id, b"", payload]``). A peer may send one raw
*attachment* frame after the payload (``[id, payload, attachment]``): a bandwidth probe's chunk,
sent without copying and only counted by the receiver.

Sends never block (``NOBLOCK``). A DEALER queues at most ``_PEER_HWM`` frames for a peer that is
not connected yet (so the first frames to a new peer are not lost); beyond that a send is dropped
and counted, like a lost packet. A failed peer's DEALER is closed with its queue.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from chaos.daemon.config import IPC_PATH_MAX

from chaos.errors import ConfigError
from chaos.security import HandshakeRefusal, HandshakeWatch, Security, authenticated_key
from chaos.sockets import keep_alive, start_zero_copy_collector

log = logging.getLogger("chaos.daemon.transport")

_DRAIN_PER_SOCKET = 256
_ZERO_COPY_MIN_BYTES = 64 * 1024
_PEER_HWM = 1000
_NOTIFY_HWM = 64
NOTIFY_SUFFIX = ".notify"
_HANDSHAKE_IVL_MS = 5_000
_HANDSHAKE_LOG_FIRST = 5
"""Refused handshakes logged one by one; after these, one summary line every
:data:`_HANDSHAKE_LOG_EVERY` (a stranger reconnecting in a loop must not flood the log)."""
_HANDSHAKE_LOG_EVERY = 1000
"""The notifier's IPC path is the daemon's IPC path plus this."""


def _log_refusal(refusal: HandshakeRefusal) -> None:
    """Logs a refused handshake (past the first ones, with how many were refused so far)."""
    n = refusal.count
    more = "" if n < _HANDSHAKE_LOG_FIRST else f"; {n} refused so far, logging every "
    more += f"{_HANDSHAKE_LOG_EVERY}th" if more else ""
    log.warning(
        "refused a connection on %s: CURVE handshake failed (%s): the peer has no or "
        "a different cluster key%s", refusal.endpoint, refusal.detail, more,
    )  # fmt: skip


class FaultInjector:
    """Named transport faults, for tests and the harness (never sleep-and-hope).

    A blocked peer's frames are dropped on send, and on receive once the sender id is decoded,
    exactly like a network that loses them. Frames without a sender (CLI, trainer) are never
    blocked, so a partitioned daemon can still be inspected.

    Faults:
        ``drop_to(peers)``: drop what this node sends to ``peers``.
        ``drop_from(peers)``: drop what this node receives from ``peers``.
        ``cut_link(peers)``: both directions between this node and each of ``peers``.
        ``partition(keep)``: both directions with every node not in ``keep`` (this node's side).
        ``clear()``: remove every fault.
    """

    def __init__(self) -> None:
        self._to: set[str] = set()
        self._from: set[str] = set()
        self._keep: frozenset[str] | None = None
        self.dropped = 0

    def drop_to(self, peers: Iterable[str]) -> None:
        """Drops frames sent to ``peers``."""
        self._to.update(peers)

    def drop_from(self, peers: Iterable[str]) -> None:
        """Drops frames received from ``peers``."""
        self._from.update(peers)

    def cut_link(self, peers: Iterable[str]) -> None:
        """Drops both directions with ``peers``."""
        p = set(peers)
        self._to |= p
        self._from |= p

    def partition(self, keep: Iterable[str]) -> None:
        """Drops both directions with every node outside ``keep``."""
        self._keep = frozenset(keep)

    def clear(self) -> None:
        """Removes every fault."""
        self._to.clear()
        self._from.clear()
        self._keep = None

    def apply(self, name: str, peers: list[str]) -> None:
        """Applies a fault by name.

        Args:
            name: ``drop_to``, ``drop_from``, ``cut_link``, ``partition`` or ``clear``.
            peers: Its peers.

        Raises:
            ValueError: unknown fault name.
        """
        if name == "drop_to":
            self.drop_to(peers)
        elif name == "drop_from":
            self.drop_from(peers)
        elif name == "cut_link":
            self.cut_link(peers)
        elif name == "partition":
            self.partition(peers)
        elif name == "clear":
            self.clear()
        else:
            raise ValueError(f"unknown fault {name!r}")

    def blocks_out(self, peer: str) -> bool:
        """Whether a frame to ``peer`` is dropped."""
        return peer in self._to or (self._keep is not None and peer not in self._keep)

    def blocks_in(self, peer: str) -> bool:
        """Whether a frame from ``peer`` (its decoded sender) is dropped."""
        if not peer:
            return False
        return peer in self._from or (self._keep is not None and peer not in self._keep)

    def describe(self) -> list[str]:
        """The active faults as readable strings."""
        out = [f"drop_to:{p}" for p in sorted(self._to)]
        out += [f"drop_from:{p}" for p in sorted(self._from)]
        if self._keep is not None:
            out.append("partition:" + ",".join(sorted(self._keep)))
        return out


@dataclass
class ReplyPath:
    """Where a reply to an inbound frame goes: the socket and the routing envelope."""

    socket: zmq.Socket[bytes]
    envelope: list[bytes] = field(default_factory=list)
    local: bool = False


@dataclass
class Inbound:
    """One inbound frame and how to answer it (``frame`` is ``None`` for a bad multipart).

    ``attachment`` is the raw frame that followed it, if any (a bulk probe's chunk).
    """

    frame: bytes | None
    reply: ReplyPath
    attachment: bytes | memoryview | None = None
    peer_key: str | None = None
    """The CURVE public key of the connection it came in on (``None``: not authenticated, i.e.
    the local IPC socket, a DEALER's reply, or a daemon without a cluster key)."""


class Transport:
    """The daemon's sockets.

    Args:
        listen: TCP endpoint to bind.
        ipc_endpoint: IPC endpoint to bind (its directory is created with mode 0700).
        max_frame_bytes: Frame cap; ZeroMQ drops connections that send frames over 4x this.
        faults: The fault injector consulted on every send and receive.
        security: The cluster key and this node's keypair (default: none, plain sockets). With
            a key the TCP ROUTER is a CURVE server and every DEALER a CURVE client; the IPC
            socket stays plain (the run directory's permissions guard it).

    Raises:
        ConfigError: an endpoint cannot be bound (in use, bad address, no permission).
    """

    def __init__(
        self, listen: str, ipc_endpoint: str, max_frame_bytes: int, faults: FaultInjector,
        security: Security | None = None,
    ) -> None:  # fmt: skip
        start_zero_copy_collector()  # probe chunks go out uncopied: its descriptors from now on
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.security = security if security is not None else Security()
        self.security.authenticate(self.ctx)
        self.faults = faults
        self.max_frame_bytes = max_frame_bytes
        self.send_failures = 0
        self.max_dealers = 512
        """Most DEALERs (peers and join contacts) open at once (``max_peer_sockets``)."""
        self.socket_failures = 0
        """DEALERs not opened: over ``max_dealers``, or ZeroMQ refused (too many sockets)."""
        self.handshake_failures = 0
        """TCP connections refused in the CURVE handshake (no or a wrong cluster key)."""
        self.on_refused: Callable[[str], object] | None = None
        """Called with ``"handshake_failed"`` for each of them (the daemon counts it in its
        refusal metrics)."""
        self.router = self._router(listen, tcp=True)
        self._handshakes = self._watch_handshakes(self.router)
        path = ipc_endpoint.removeprefix("ipc://")
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # the CLI checked that no live daemon owns it
        self.ipc = self._router(ipc_endpoint)
        self.ipc_endpoint = ipc_endpoint
        self.notify_endpoint, self._notify = self._notifier(path)
        self.dealers: dict[str, tuple[str, zmq.Socket[bytes]]] = {}
        self.contacts: dict[str, zmq.Socket[bytes]] = {}
        self._contact_monitors: dict[str, HandshakeWatch] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.ipc, zmq.POLLIN)
        if self._handshakes is not None:
            self.poller.register(self._handshakes.monitor, zmq.POLLIN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)

    def wakeup_fd(self) -> int:
        """A file descriptor whose writes wake :meth:`poll` (for ``signal.set_wakeup_fd``)."""
        return self._wake_w.fileno()

    def _notifier(self, ipc_path: str) -> tuple[str | None, zmq.Socket[bytes] | None]:
        """The PUB socket beside the IPC endpoint on which trainers hear of new epochs
        (``None`` when its path would be over the unix socket limit: trainers then poll)."""
        path = ipc_path + NOTIFY_SUFFIX
        if len(path.encode()) > IPC_PATH_MAX:
            return None, None
        if os.path.exists(path):
            os.unlink(path)  # left by a daemon that died; the CLI checked that none is live
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _NOTIFY_HWM)
        sock.bind("ipc://" + path)
        return "ipc://" + path, sock

    def publish(self, frame: bytes) -> None:
        """Publishes a notice to the local trainers (dropped, never blocking, if none listen)."""
        if self._notify is not None:
            try:
                self._notify.send(frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("notice not published: %s", exc)

    def _watch_handshakes(self, sock: zmq.Socket[bytes]) -> HandshakeWatch | None:
        """A watch on the failed CURVE handshakes on ``sock`` (``None`` when insecure)."""
        if not self.security.enabled:
            return None
        return HandshakeWatch(
            sock, on_refused=self._count_refusal, report=_log_refusal,
            log_first=_HANDSHAKE_LOG_FIRST, log_every=_HANDSHAKE_LOG_EVERY,
        )  # fmt: skip

    def _count_refusal(self, _refusal: HandshakeRefusal) -> None:
        self.handshake_failures += 1
        if self.on_refused is not None:
            self.on_refused("handshake_failed")

    def _drain_handshakes(self) -> None:
        if self._handshakes is not None:
            self._handshakes.drain(_DRAIN_PER_SOCKET)

    def _router(self, endpoint: str, tcp: bool = False) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        keep_alive(sock)  # drops a peer's half-open connection
        if tcp:
            self.security.server(sock)  # a CURVE server with a cluster key
            # a TCP connection that has not completed its handshake within this is dropped
            # (keyed or not), so idle strangers do not hold descriptors for libzmq's 30 s
            sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"cannot bind {endpoint}: {exc.strerror}") from exc
        return sock

    def _dealer(self, address: str, watch: bool = False) -> zmq.Socket[bytes] | None:
        """A new DEALER to ``address``; ``None`` (logged, counted in ``socket_failures``) when
        ``max_dealers`` are open or ZeroMQ cannot make one (too many sockets or files).
        ``watch``: monitor its failed handshakes from before it connects (a mechanism mismatch
        fails the first handshake only: ZeroMQ does not retry it)."""
        if len(self.dealers) + len(self.contacts) >= self.max_dealers:
            self._socket_failed(address, f"{self.max_dealers} peer sockets open (the budget)")
            return None
        try:
            sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:  # EMFILE: ZeroMQ's socket limit or the process's files
            self._socket_failed(address, exc.strerror)
            return None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _PEER_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)
            # a connection sending when its link went down is dropped and made again (user
            # timeout), not left retransmitting on a back-off long after the link is back
            keep_alive(sock)
            self.security.client(sock)
            if watch:
                self._contact_monitors[address] = HandshakeWatch(sock)
            sock.connect(address)
        except zmq.ZMQError as exc:
            mon = self._contact_monitors.pop(address, None) if watch else None
            if mon is not None:
                mon.close()
            sock.close(linger=0)
            self._socket_failed(address, exc.strerror)
            return None
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _socket_failed(self, address: str, why: str) -> None:
        self.socket_failures += 1
        n = self.socket_failures
        if n == 1 or n % 100 == 0:  # a flood must not flood the log too
            log.warning("no socket to %s: %s (%d refused so far)", address, why, n)

    def ensure_peer(self, peer: str, address: str) -> bool:
        """Opens (or re-points) the DEALER to ``peer`` at ``address``.

        Returns:
            ``True`` when that DEALER was already open (its connection is likely up).
        """
        cur = self.dealers.get(peer)
        if cur is not None and cur[0] == address:
            return True
        if cur is not None:
            self.drop_peer(peer)
        sock = self._dealer(address)
        if sock is not None:  # else its frames are dropped and counted, like lost packets
            self.dealers[peer] = (address, sock)
        return False

    def drop_peer(self, peer: str) -> None:
        """Closes the DEALER to ``peer`` (no-op if none)."""
        cur = self.dealers.pop(peer, None)
        if cur is not None:
            self.poller.unregister(cur[1])
            cur[1].close(linger=0)

    def send_peer(self, peer: str, frame: bytes, attachment: bytes | None = None) -> bool:
        """Sends a frame to ``peer`` on its DEALER.

        Args:
            peer: The peer's id.
            frame: The encoded message.
            attachment: A raw frame sent after it, without copying (it must not change until
                ZeroMQ has sent it; pass immutable ``bytes``).

        Returns:
            ``False`` when dropped: no DEALER, a fault, or the peer is not connected.
        """
        cur = self.dealers.get(peer)
        if cur is None:
            self.send_failures += 1
            return False
        if self.faults.blocks_out(peer):
            self.faults.dropped += 1
            return False
        return self._send(cur[1], [frame] if attachment is None else [frame, attachment])

    def send_contact(self, address: str, frame: bytes) -> bool:
        """Sends to an address whose node id is not known yet (a join contact); its failed
        security handshakes are watched (:meth:`refused_contact`)."""
        sock = self.contacts.get(address)
        if sock is None:
            sock = self._dealer(address, watch=True)
            if sock is None:
                self.send_failures += 1
                return False
            self.contacts[address] = sock
        return self._send(sock, [frame])

    def refused_contact(self) -> str | None:
        """The first join contact whose server refused this node's security handshake (no,
        a wrong or an unexpected cluster key), or ``None``."""
        for address, mon in self._contact_monitors.items():
            if mon.pending():
                return address
        return None

    def close_contacts(self) -> None:
        """Closes every join-contact DEALER (and its handshake monitor)."""
        for address, sock in self.contacts.items():
            self.poller.unregister(sock)
            mon = self._contact_monitors.pop(address, None)
            if mon is not None:
                mon.close()
            sock.close(linger=0)
        self.contacts.clear()

    def reply(self, path: ReplyPath, frame: bytes) -> bool:
        """Answers an inbound frame on the socket it came in on."""
        return self._send(path.socket, [*path.envelope, frame])

    def _send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
        try:
            # zero-copy pays only for bulk frames; a small one is cheaper copied
            copy = len(frames[-1]) < _ZERO_COPY_MIN_BYTES
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.send_failures += 1
            return False
        except zmq.ZMQError as exc:  # e.g. EHOSTUNREACH: the peer is gone
            log.debug("send failed: %s", exc)
            self.send_failures += 1
            return False
        return True

    def poll(self, timeout_s: float) -> list[Inbound]:
        """Waits up to ``timeout_s`` for frames and returns what arrived (bounded per socket).

        Args:
            timeout_s: Longest wait in seconds (0: do not wait).

        Returns:
            The inbound frames.
        """
        # zmq_poll takes whole milliseconds: round up, so a timer 0.4 ms away sleeps 1 ms
        # instead of spinning until it is due
        events = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))
        out: list[Inbound] = []
        for sock in events:
            if self._handshakes is not None and sock is self._handshakes.monitor:
                self._drain_handshakes()
                continue
            if not isinstance(sock, zmq.Socket):
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
                continue
            is_router = sock is self.router or sock is self.ipc
            for _ in range(_DRAIN_PER_SOCKET):
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                inbound = self._split(sock, frames, is_router)
                if sock is self.router and len(frames) > 1:
                    inbound.peer_key = authenticated_key(frames[-1])
                out.append(inbound)
        return out

    @staticmethod
    def _split(sock: zmq.Socket[bytes], frames: list[zmq.Frame], is_router: bool) -> Inbound:
        envelope: list[bytes] = []
        if is_router:
            envelope, frames = [frames[0].bytes], frames[1:]
        if len(frames) == 2 and len(frames[0]) == 0:  # a REQ client's delimiter
            envelope, frames = [*envelope, b""], frames[1:]
        path = ReplyPath(sock, envelope)
        if len(frames) == 2 and len(frames[0]) > 0:
            # a payload and its attachment (a probe chunk): the attachment is only counted, so
            # it stays in ZeroMQ's buffer instead of being copied out on arrival
            return Inbound(frames[0].bytes, path, frames[1].buffer)
        if len(frames) != 1:
            return Inbound(None, path)
        return Inbound(frames[0].bytes, path)

    def close(self, linger_s: float = 0.0) -> None:
        """Closes every socket and removes the IPC socket file.

        Args:
            linger_s: How long DEALERs may still flush queued frames (e.g. a scheduler
                handover sent just before exiting).
        """
        linger = int(linger_s * 1000)
        for _, sock in self.dealers.values():
            sock.close(linger=linger)
        self.dealers.clear()
        self.close_contacts()
        if self._handshakes is not None:
            self._handshakes.close()
        self.router.close(linger=0)
        self.ipc.close(linger=0)
        if self._notify is not None:
            self._notify.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()
        self.security.release(self.ctx)
        self.ctx.term()  # waits at most linger_s for the DEALERs' queued frames
        path = self.ipc_endpoint.removeprefix("ipc://")
        for p in (path, (self.notify_endpoint or "").removeprefix("ipc://")):
            try:
                if p:
                    os.unlink(p)
            except OSError:
                pass
