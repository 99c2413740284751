"""The sending end of a payload lane: :class:`OutLane` and its writer thread.

See :mod:`chaos.collectives.lanes` for how lanes are set up and :mod:`chaos.collectives.lane_wire`
for what they carry. The frames a lane that died did not write go back to ZeroMQ
(:func:`resend`).
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from chaos.collectives.lane_crypto import (
    TAG_BYTES,
    TO_RECEIVER,
    TO_SENDER,
    LaneCipher,
    RecordJob,
    crypto_workers,
    record_spans,
    wait_all,
)
from chaos.collectives.lane_wire import (
    ACK,
    SEALED_ACK,
    encode_hello,
    encode_sealed_hello,
    flat,
    set_timeo,
    tune_socket,
)
from chaos.errors import PeerTimeout

__all__ = ["OutLane", "resend"]

log = logging.getLogger("chaos.collectives")


@dataclass
class _Sealing:
    """A frame being sealed: its header record, its payload's records, their jobs."""

    header: bytes
    records: list[memoryview]
    jobs: list[RecordJob]


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
            self._seal = LaneCipher(key, attempt, TO_RECEIVER)
            self._unseal = LaneCipher(key, attempt, TO_SENDER)
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
            tune_socket(sock)
            set_timeo(sock, socket.SO_SNDTIMEO, self._slice_s)
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
                    wait_all(ahead.jobs)

    def _seal_frame(
        self, seal: LaneCipher, item: tuple[bytes, memoryview, Any], buffer: int
    ) -> _Sealing:
        """Starts sealing a frame into buffer ``buffer``: its header record here, its payload's
        records (:data:`~chaos.wire.LANE_RECORD_BYTES` each, straight from the caller's
        buffer) by the record workers. Nonces are taken in the order the frames are written."""
        data = flat(item[1])
        spans = record_spans(len(data))
        need = len(data) + TAG_BYTES * len(spans)
        if len(self._scratch[buffer]) < need:
            self._scratch[buffer] = bytearray(need)
        out = memoryview(self._scratch[buffer])
        header = seal.seal(item[0])
        records = [
            out[lo + TAG_BYTES * j : hi + TAG_BYTES * (j + 1)] for j, (lo, hi) in enumerate(spans)
        ]
        workers = crypto_workers()
        jobs = [workers.submit(seal.seal_at, seal.next_nonce(), data[lo:hi], records[j])
                for j, (lo, hi) in enumerate(spans)]  # fmt: skip
        return _Sealing(header, records, jobs)

    def _await_ack(self, sock: socket.socket) -> None:
        """Waits (up to the connect timeout) for the receiver to accept the hello.

        Raises:
            OSError: refused (closed), no answer in time, or (sealed) an answer that fails
                authentication.
        """
        set_timeo(sock, socket.SO_RCVTIMEO, self._connect_timeout_s)
        if self._unseal is None:
            if sock.recv(1) != ACK:
                raise OSError("the receiver refused the lane")
            return
        got = b""
        while len(got) < SEALED_ACK:
            chunk = sock.recv(SEALED_ACK - len(got))
            if not chunk:
                raise OSError("the receiver refused the lane")
            got += chunk
        if self._unseal.open(got) != ACK:
            raise OSError("the receiver's answer failed authentication")

    def _write(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Writes all of ``views``, in slices of at most ``slice_s`` blocking each.

        Raises:
            OSError: the connection failed.
            _Closed: :meth:`close` was called meanwhile.
        """
        views = [flat(v) for v in views]
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
