"""The receiving end of a payload lane: :class:`InLane` and :func:`read_frame`.

See :mod:`chaos.collectives.lanes` for how lanes are set up and :mod:`chaos.collectives.lane_wire`
for what they carry. A frame's payload is read straight into its destination (see
:data:`Place`); a sealed payload's records are opened there, the record workers opening one
while the next is read.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch

from chaos.collectives.frames import DATA_OPS, HEADER_BYTES, Header, decode_header
from chaos.collectives.lane_crypto import (
    TAG_BYTES,
    LaneCipher,
    RecordJob,
    crypto_workers,
    record_spans,
    wait_all,
)
from chaos.collectives.lane_wire import SEALED_HEADER, flat, set_timeo
from chaos.collectives.links import Frame, LanePayload
from chaos.errors import ProtocolError

__all__ = ["InLane", "Place", "read_frame"]

Place = Callable[[str, Header], "memoryview | None"]
"""Where a lane frame's payload goes: a writable region of the round's result buffer, or
``None`` for a buffer of its own (see ``Communicator.recv``)."""


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
            set_timeo(self.sock, socket.SO_RCVTIMEO, timeout_s)
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
        view = flat(view)
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
    raw = bytearray(SEALED_HEADER if sealed is not None else HEADER_BYTES)
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
        status = _read_sealed_payload(lane, sealed, flat(buf), deadline, between)
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
    spans = record_spans(len(dest))
    record = lane.scratch(len(dest) + TAG_BYTES * len(spans))
    workers = crypto_workers() if len(spans) > 1 else None
    jobs: list[RecordJob] = []
    try:
        for j, (lo, hi) in enumerate(spans):
            part = record[lo + TAG_BYTES * j : hi + TAG_BYTES * (j + 1)]
            status = lane.read_into(part, deadline, between)
            if status is not None:
                return status
            nonce = sealed.next_nonce()
            if workers is not None and j < len(spans) - 1:
                jobs.append(workers.submit(sealed.open_at, nonce, part, dest[lo:hi]))
            elif not sealed.open_at(nonce, part, dest[lo:hi]):
                return f"malformed: {_FORGED} (a payload)"
    finally:
        opened = wait_all(jobs)  # none still writes into dest once this returns
    if not all(opened):
        return f"malformed: {_FORGED} (a payload)"
    return None


_FORGED = "a record failed authentication: tampered, injected or not sealed with the lane key"
