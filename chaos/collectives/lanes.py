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

**Sealed lanes** (a communicator with a cluster key, ``Lanes(sealed=True)``): the offer, which
travels inside the CURVE-encrypted ZeroMQ link, also carries a fresh random 32-byte lane key,
and every byte on the lane is an AES-256-GCM record under that key (:class:`LaneCipher`): the
hello (``b"CHLS"``, u8 version, u32 attempt, u16 sealed length, then the sealed token and id,
the 11 clear bytes authenticated as associated data), the acknowledgement, and each frame's
header and payload as two records. A record's nonce is its direction, the connection's attempt
number and a counter of that direction's records; the sender numbers its connections to one
offer 0, 1, ... and the receiver accepts each attempt of a key at most once, so no nonce is
used twice with a key and a recorded lane cannot be replayed. The token alone is useless
without the key, and a record that fails authentication (tampered, injected or replayed) closes
the lane like a malformed frame. The receiver finds the offer a hello answers by opening it
with each current offer's key: nothing on the lane names the peer in clear.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import queue
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
from chaos.wire import LANE_HELLO_BODY as _HELLO_BODY
from chaos.wire import LANE_MAGIC as _MAGIC
from chaos.wire import LANE_NONCE as _NONCE
from chaos.wire import LANE_OFFER as _OFFER
from chaos.wire import LANE_RECORD_BYTES, LANE_VERSION
from chaos.wire import LANE_SEALED_HELLO as _SEALED_HELLO
from chaos.wire import LANE_SEALED_MAGIC as _SEALED_MAGIC
from chaos.wire import LANE_SEALED_OFFER as _SEALED_OFFER

__all__ = [
    "LANE_KEY_BYTES", "LANE_VERSION", "InLane", "LaneCipher", "Lanes", "OutLane", "Place",
    "decode_offer", "decode_sealed_offer", "encode_hello", "encode_offer", "encode_sealed_hello",
    "encode_sealed_offer", "endpoint_host", "open_lanes", "read_frame", "resend",
]  # fmt: skip

Place = Callable[[str, Header], "memoryview | None"]
"""Where a lane frame's payload goes: a writable region of the round's result buffer, or
``None`` for a buffer of its own (see ``Communicator.recv``)."""

log = logging.getLogger("chaos.collectives")

_ACK = b"\x01"
_MAX_ID = 255
_PENDING_LIMIT = 64
"""Accepted connections still owing their hello; beyond this the oldest is dropped."""

LANE_KEY_BYTES = 32
"""A sealed lane's AES-256-GCM key, fresh for every offer."""
_TAG = 16
"""Bytes an AES-GCM record adds to its plaintext (the authentication tag)."""
_SEALED_HEADER = HEADER_BYTES + _TAG
_SEALED_ACK = len(_ACK) + _TAG
_MAX_ATTEMPT = (1 << 24) - 1
"""Connections one sealed offer may be tried with (the attempt has 24 bits of the nonce)."""
_MAX_SEALED_BODY = _HELLO_BODY.size + _MAX_ID + _TAG
_TO_RECEIVER = 0
"""Nonce direction of the records the connecting side (the sender of the data) writes."""
_TO_SENDER = 1
"""Nonce direction of the records the accepting side (the receiver) writes: the ack."""


class LaneCipher:
    """AES-256-GCM records of one direction of one lane connection.

    The ``i``-th record sealed (or opened) uses the nonce ``(direction << 24 | attempt, i)``
    (:data:`chaos.wire.LANE_NONCE`); both ends count the records of a direction in the same
    order, so a record that is dropped, reordered or replayed fails to open.

    Args:
        key: The lane key (32 bytes, from the offer).
        attempt: The connection's attempt number for this key (0 to 2**24 - 1).
        direction: :data:`_TO_RECEIVER` or :data:`_TO_SENDER`.

    Raises:
        ValueError: a key of another size, or an attempt out of range.
    """

    def __init__(self, key: bytes, attempt: int, direction: int) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(key) != LANE_KEY_BYTES:
            raise ValueError(f"a lane key is {LANE_KEY_BYTES} bytes")
        if not 0 <= attempt <= _MAX_ATTEMPT:
            raise ValueError(f"lane attempt {attempt} out of range")
        self._aead = AESGCM(key)
        self._prefix = (direction << 24) | attempt
        self._counter = 0
        self._into = hasattr(self._aead, "encrypt_into")

    def next_nonce(self) -> bytes:
        """The next record's nonce (records must be sealed or opened in this order of their
        nonces; :meth:`seal_at` and :meth:`open_at` then run in any thread)."""
        nonce = _NONCE.pack(self._prefix, self._counter)
        self._counter += 1
        return nonce

    def seal(self, data: bytes | memoryview, aad: bytes | None = None) -> bytes:
        """The next record: ``data`` encrypted, with its tag (``len(data) + 16`` bytes)."""
        return self._aead.encrypt(self.next_nonce(), data, aad)

    def seal_into(self, data: memoryview, out: memoryview) -> None:
        """Seals the next record into ``out`` (exactly ``len(data) + 16`` bytes): one pass
        over the payload, no copy of its own."""
        self.seal_at(self.next_nonce(), data, out)

    def seal_at(self, nonce: bytes, data: memoryview, out: memoryview) -> None:
        """Seals ``data`` under ``nonce`` (from :meth:`next_nonce`) into ``out``."""
        if self._into:
            self._aead.encrypt_into(nonce, data, None, out)
        else:  # cryptography < 45: one copy more
            out[:] = self._aead.encrypt(nonce, data, None)

    def open(
        self, record: bytes | bytearray | memoryview, aad: bytes | None = None
    ) -> bytes | None:
        """The plaintext of the next record, or ``None`` when it fails authentication."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self.next_nonce(), record, aad)
        except InvalidTag:
            return None

    def open_into(self, record: memoryview, out: memoryview) -> bool:
        """Opens the next record into ``out`` (exactly ``len(record) - 16`` bytes).

        Returns:
            ``False`` when it fails authentication (``out`` then holds garbage: the caller
            must not use it).
        """
        return self.open_at(self.next_nonce(), record, out)

    def open_at(self, nonce: bytes, record: memoryview, out: memoryview) -> bool:
        """Opens ``record`` sealed under ``nonce`` into ``out``; ``False``: not authentic."""
        from cryptography.exceptions import InvalidTag

        try:
            if self._into:
                self._aead.decrypt_into(nonce, record, None, out)
            else:  # cryptography < 45: one copy more
                out[:] = self._aead.decrypt(nonce, record, None)
        except InvalidTag:
            return False
        return True


@dataclass
class _Sealing:
    """A frame being sealed: its header record, its payload's records, their jobs."""

    header: bytes
    records: list[memoryview]
    jobs: list[_Job]


class _Job:
    """One sealing or opening job run by :class:`_Workers`; :meth:`wait` returns its result."""

    __slots__ = ("_args", "_done", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = _thread.allocate_lock()
        self._done.acquire()

    def run(self) -> None:
        try:
            self._result = self._fn(*self._args)
        except BaseException as exc:  # handed to the waiter
            self._error = exc
        finally:
            self._done.release()

    def wait(self) -> Any:
        """The job's result (blocks until it ran; it takes microseconds).

        Raises:
            BaseException: what the job raised.
        """
        self._done.acquire()
        self._done.release()
        if self._error is not None:
            raise self._error
        return self._result


class _Workers:
    """A few threads that seal and open lane records beside the threads that write and read
    them (AES-GCM releases the GIL), so that a chunk's crypto overlaps its transfer."""

    def __init__(self, count: int) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for _ in range(count):
            _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while True:
            self._jobs.get().run()

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Job:
        job = _Job(fn, args)
        self._jobs.put(job)
        return job


_workers: _Workers | None = None
_workers_lock = threading.Lock()


def _crypto_workers() -> _Workers:
    """The process's record workers (started at the first sealed lane): one, or two from 16
    cores (more only compete with the threads moving the bytes: on a 16-core host with four
    members, four each were slower than two)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = _Workers(max(1, min(2, (os.cpu_count() or 1) // 8)))
        return _workers


def _spans(nbytes: int) -> list[tuple[int, int]]:
    """The plaintext ``(start, end)`` of each record of a sealed payload of ``nbytes``."""
    return [(lo, min(nbytes, lo + LANE_RECORD_BYTES))
            for lo in range(0, nbytes, LANE_RECORD_BYTES)] or [(0, 0)]  # fmt: skip


def _wait_all(jobs: list[_Job]) -> list[Any]:
    """The results of ``jobs``, once all ran (the first error is raised after all ran)."""
    out: list[Any] = []
    error: BaseException | None = None
    for job in jobs:
        try:
            out.append(job.wait())
        except BaseException as exc:  # noqa: BLE001 - re-raised once every job is done
            error = error or exc
    if error is not None:
        raise error
    return out


def encode_offer(port: int, token: int) -> bytes:
    """The payload of an ``Op.LANE`` offer."""
    return _OFFER.pack(port, token)


def encode_sealed_offer(port: int, token: int, key: bytes) -> bytes:
    """The payload of an ``Op.LANE`` offer of a sealed lane (it carries the lane key, so it
    must travel only inside an encrypted link)."""
    return _SEALED_OFFER.pack(port, token, key)


def decode_sealed_offer(raw: bytes | memoryview) -> tuple[int, int, bytes]:
    """``(port, token, key)`` of a sealed lane's offer.

    Raises:
        ProtocolError: wrong size (e.g. an offer without a key) or port 0.
    """
    if len(raw) != _SEALED_OFFER.size:
        raise ProtocolError(f"sealed lane offer is {len(raw)} bytes, expected "
                            f"{_SEALED_OFFER.size}")  # fmt: skip
    port, token, key = _SEALED_OFFER.unpack(raw)
    if port == 0:
        raise ProtocolError("lane offer names port 0")
    return int(port), int(token), bytes(key)


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


def encode_sealed_hello(node_id: str, token: int, cipher: LaneCipher, attempt: int) -> bytes:
    """The first bytes of a sealed lane: the clear prefix, then the token and id sealed with
    ``cipher`` (the connection's :data:`_TO_RECEIVER` cipher, whose first record it is).

    Raises:
        ValueError: the node id is longer than 255 bytes.
    """
    raw = node_id.encode()
    if not 0 < len(raw) <= _MAX_ID:
        raise ValueError("a lane hello needs a node id of 1 to 255 bytes")
    body = _HELLO_BODY.pack(token, len(raw)) + raw
    prefix = _SEALED_HELLO.pack(_SEALED_MAGIC, LANE_VERSION, attempt, len(body) + _TAG)
    return prefix + cipher.seal(body, prefix)


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
        key: The sealed offer's lane key (``None``: a plain lane).
        attempt: This connection's number among those made for the same sealed offer.
    """

    def __init__(self, peer: str, host: str, port: int, token: int, node_id: str,
                 connect_timeout_s: float, slice_s: float, key: bytes | None = None,
                 attempt: int = 0) -> None:  # fmt: skip
        self.peer = peer
        self.port = port
        self.token = token
        self.attempt = attempt
        self._address = (host, port)
        self._seal: LaneCipher | None = None
        self._unseal: LaneCipher | None = None
        self._scratch = [bytearray(), bytearray()]
        if key is None:
            self._hello = encode_hello(node_id, token)
        else:
            self._seal = LaneCipher(key, attempt, _TO_RECEIVER)
            self._unseal = LaneCipher(key, attempt, _TO_SENDER)
            self._hello = encode_sealed_hello(node_id, token, self._seal, attempt)
        self._connect_timeout_s = connect_timeout_s
        self._slice_s = slice_s
        self._cv = threading.Condition()
        self._queue: deque[tuple[bytes, memoryview, Any]] = deque()
        self._queued = 0
        self._done = 0
        # taken from the queue, not yet fully written (a sealed lane seals one frame ahead)
        self._inflight: list[tuple[bytes, memoryview, Any]] = []
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
            if self._seal is not None:
                self._send_sealed(sock, self._seal)
                return
            while True:
                item = self._next()
                if item is None:
                    return
                if _closed_by_peer(sock):
                    raise OSError("the receiver closed the lane")
                self._write(sock, [memoryview(item[0]), item[1]])
                self._written()
        except (OSError, _Closed) as exc:
            if not self._closing:
                log.debug("lane to %s failed: %s", self.peer, exc)
        finally:
            with self._cv:
                self._dead = True
                if not self._closing:  # not fully written: send them again
                    self._queue.extendleft(reversed(self._inflight))
                self._inflight.clear()
                self._cv.notify_all()
            if sock is not None:
                sock.close()

    def _next(self, wait: bool = True) -> tuple[bytes, memoryview, Any] | None:
        """Takes the next queued frame (waiting for one if ``wait``) into the in-flight ones;
        ``None`` when closing (or, without ``wait``, none is queued)."""
        with self._cv:
            while wait and not self._queue and not self._closing:
                self._cv.wait()
            if self._closing or not self._queue:
                return None
            item = self._queue.popleft()
            self._inflight.append(item)
            return item

    def _written(self) -> None:
        """The oldest in-flight frame is written."""
        with self._cv:
            self._inflight.pop(0)
            self._done += 1
            self._cv.notify_all()

    def _send_sealed(self, sock: socket.socket, seal: LaneCipher) -> None:
        """The sealed lane's write loop: while one frame is written, the next queued one is
        already being sealed by the record workers (into the other of two buffers), so that
        the writes follow each other without waiting for the crypto.

        Raises:
            OSError, _Closed: as :meth:`_write`.
        """
        ahead: _Sealing | None = None
        buffer = 0
        try:
            while True:
                if ahead is None:
                    item = self._next()
                    if item is None:
                        return
                    ahead, buffer = self._seal_frame(seal, item, buffer), buffer ^ 1
                cur, ahead = ahead, None
                item = self._next(wait=False)
                if item is not None:
                    ahead, buffer = self._seal_frame(seal, item, buffer), buffer ^ 1
                if _closed_by_peer(sock):
                    raise OSError("the receiver closed the lane")
                for j, (job, record) in enumerate(zip(cur.jobs, cur.records, strict=True)):
                    job.wait()
                    self._write(sock, [memoryview(cur.header), record] if j == 0 else [record])
                self._written()
        finally:
            if ahead is not None:  # none still writes into a buffer once the thread ends
                with contextlib.suppress(BaseException):
                    _wait_all(ahead.jobs)

    def _seal_frame(
        self, seal: LaneCipher, item: tuple[bytes, memoryview, Any], buffer: int
    ) -> _Sealing:
        """Starts sealing a frame into buffer ``buffer``: its header record here, its payload's
        records (:data:`~chaos.wire.LANE_RECORD_BYTES` each, straight from the caller's
        buffer) by the record workers. Nonces are taken in the order the frames are written."""
        data = _flat(item[1])
        spans = _spans(len(data))
        need = len(data) + _TAG * len(spans)
        if len(self._scratch[buffer]) < need:
            self._scratch[buffer] = bytearray(need)
        out = memoryview(self._scratch[buffer])
        header = seal.seal(item[0])
        records = [out[lo + _TAG * j : hi + _TAG * (j + 1)] for j, (lo, hi) in enumerate(spans)]
        workers = _crypto_workers()
        jobs = [workers.submit(seal.seal_at, seal.next_nonce(), data[lo:hi], records[j])
                for j, (lo, hi) in enumerate(spans)]  # fmt: skip
        return _Sealing(header, records, jobs)

    def _await_ack(self, sock: socket.socket) -> None:
        """Waits (up to the connect timeout) for the receiver to accept the hello.

        Raises:
            OSError: refused (closed), no answer in time, or (sealed) an answer that fails
                authentication.
        """
        _set_timeo(sock, socket.SO_RCVTIMEO, self._connect_timeout_s)
        if self._unseal is None:
            if sock.recv(1) != _ACK:
                raise OSError("the receiver refused the lane")
            return
        got = b""
        while len(got) < _SEALED_ACK:
            chunk = sock.recv(_SEALED_ACK - len(got))
            if not chunk:
                raise OSError("the receiver refused the lane")
            got += chunk
        if self._unseal.open(got) != _ACK:
            raise OSError("the receiver's answer failed authentication")

    def _write(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Writes all of ``views``, in slices of at most ``slice_s`` blocking each.

        Raises:
            OSError: the connection failed.
            _Closed: :meth:`close` was called meanwhile.
        """
        views = [_flat(v) for v in views]
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


def _flat(view: memoryview) -> memoryview:
    """``view`` as flat bytes."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


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

    Args:
        peer: The neighbour's node id.
        sock: The greeted connection.
        cipher: Opens a sealed lane's records (``None``: a plain lane).
    """

    def __init__(self, peer: str, sock: socket.socket, cipher: LaneCipher | None = None) -> None:
        self.peer = peer
        self.sock = sock
        self.cipher = cipher
        self._timeout_s = -1.0
        self._scratch = bytearray()

    def scratch(self, nbytes: int) -> memoryview:
        """A reused buffer of ``nbytes`` (where a sealed payload is read before it is opened
        into its destination)."""
        if len(self._scratch) < nbytes:
            self._scratch = bytearray(nbytes)
        return memoryview(self._scratch)[:nbytes]

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
        view = _flat(view)
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
        stopped in the middle of a frame) or ``"malformed: ..."`` (a bad header, or on a sealed
        lane a record that fails authentication: the stream cannot be trusted any more). The
        caller closes the lane in every case but a frame.
    """
    lane.set_timeout(slice_s)
    sealed = lane.cipher
    raw = bytearray(_SEALED_HEADER if sealed is not None else HEADER_BYTES)
    status = lane.read_into(memoryview(raw), deadline, between)
    if status is not None:
        return status
    if sealed is not None:
        opened = sealed.open(raw)
        if opened is None:
            return f"malformed: {_FORGED} (a frame header)"
        raw = bytearray(opened)
    try:
        header = decode_header(memoryview(raw))
        nbytes = header.nelem * header.dtype.itemsize
        if header.op not in DATA_OPS or nbytes > max_bytes:
            raise ProtocolError(f"{header.op.name} frame of {nbytes} bytes on a lane")
    except ProtocolError as exc:
        return f"malformed: {exc}"
    dest = place(lane.peer, header) if place is not None and header.key == key else None
    buf = dest if dest is not None else torch.empty(nbytes, dtype=torch.uint8).numpy().data
    if sealed is None:
        status = lane.read_into(buf, deadline, between)
        if status is not None:
            return status
    else:
        status = _read_sealed_payload(lane, sealed, _flat(buf), deadline, between)
        if status is not None:
            return status
    return Frame(lane.peer, header, bytes(raw), LanePayload(buf), placed=dest is not None)


def _read_sealed_payload(
    lane: InLane,
    sealed: LaneCipher,
    dest: memoryview,
    deadline: float,
    between: Callable[[], None],
) -> str | None:
    """Reads a sealed payload's records and opens them into ``dest``: each record is handed to
    the record workers as soon as it is read, while the next one is read; the last is opened
    here.

    Returns:
        ``None`` when every record was authentic and opened, else why not (see
        :func:`read_frame`). On a failure ``dest`` holds garbage: the frame is lost with the
        lane, so the round cannot complete with it (it fails and is rerun) and never uses it.
    """
    spans = _spans(len(dest))
    record = lane.scratch(len(dest) + _TAG * len(spans))
    workers = _crypto_workers() if len(spans) > 1 else None
    jobs: list[_Job] = []
    try:
        for j, (lo, hi) in enumerate(spans):
            part = record[lo + _TAG * j : hi + _TAG * (j + 1)]
            status = lane.read_into(part, deadline, between)
            if status is not None:
                return status
            nonce = sealed.next_nonce()
            if workers is not None and j < len(spans) - 1:
                jobs.append(workers.submit(sealed.open_at, nonce, part, dest[lo:hi]))
            elif not sealed.open_at(nonce, part, dest[lo:hi]):
                return f"malformed: {_FORGED} (a payload)"
    finally:
        opened = _wait_all(jobs)  # none still writes into dest once this returns
    if not all(opened):
        return f"malformed: {_FORGED} (a payload)"
    return None


_FORGED = "a record failed authentication: tampered, injected or not sealed with the lane key"


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
        if attempt > _MAX_ATTEMPT:
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
        lo, hi = (_HELLO_BODY.size + 1 + _TAG, _MAX_SEALED_BODY) if self.sealed else (1, _MAX_ID)
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
        _tune(sock)
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
        return peer, _ACK, None

    def _open_hello(self, data: bytes) -> tuple[str, bytes, LaneCipher] | None:
        """``(peer, sealed ack, the lane's cipher)`` when a sealed hello opens with the key of a
        current offer, names that offer's peer and token, and a newer attempt than any that
        key was accepted with (a replayed hello names an old one)."""
        prefix = data[: _SEALED_HELLO.size]
        _magic, _version, attempt, _n = _SEALED_HELLO.unpack(prefix)
        if attempt > _MAX_ATTEMPT:
            return None
        for peer, offer in self._offers.items():
            if offer.key is None or attempt <= offer.accepted:
                continue
            cipher = LaneCipher(offer.key, attempt, _TO_RECEIVER)
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
            ack = LaneCipher(offer.key, attempt, _TO_SENDER).seal(_ACK)
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
        for peer in list(self._offers.keys() | self.incoming.keys() | self.outgoing.keys()):
            self.drop(peer)
        for pending in list(self._pending):
            self._refuse(pending)
        self._listener.close()
