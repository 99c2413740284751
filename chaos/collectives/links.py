"""Records and small helpers of a :class:`~chaos.collectives.communicator.Communicator`.

Internal to :mod:`chaos.collectives`: a neighbour link (:class:`Link`), a received frame
(:class:`Frame`, which the algorithms consume), the named fault of
:meth:`Communicator.fail_at <chaos.collectives.communicator.Communicator.fail_at>`
(:class:`Fault`), the catch-up signal (:class:`CaughtUp`) with the check of the result frame it
carries (:func:`result_of`), header-only notices (:func:`send_notice`) and the buffer overlap
test of the allreduce's ``out`` (:func:`overlaps`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from chaos.collectives.frames import Header, Op, encode_header
from chaos.errors import ProtocolError

__all__ = [
    "INCARNATION_SEP", "NOTICE_SUFFIX", "CaughtUp", "Fault", "Frame", "LanePayload", "Link",
    "member_of", "overlaps", "result_of", "routing_id", "send_notice",
]

NOTICE_SUFFIX = "~notice"
"""The routing id of a member's notice-only socket is its node id and this suffix."""

INCARNATION_SEP = "/"
"""Separates a routing id's member (and notice suffix) from the socket's random incarnation,
a character no node id has."""


def routing_id(member: str, notice: bool = False) -> bytes:
    """A fresh routing id for one DEALER socket of ``member``: its node id (with
    :data:`NOTICE_SUFFIX` for a notice-only socket) and a random incarnation.

    Every socket gets its own, so a new connection never clashes at a peer's ROUTER with an old
    one of the same member that the peer still holds: after a route loss the old TCP
    connection can stay half-open there (its close never arrived), and a ROUTER that does not
    hand an id over (with a cluster key, so that no key holder can take a member's connection)
    silently drops every frame of a new connection under an id in use.
    """
    suffix = NOTICE_SUFFIX if notice else ""
    return f"{member}{suffix}{INCARNATION_SEP}{secrets.token_hex(4)}".encode()


def member_of(routing: bytes) -> str:
    """The member a data-endpoint message's routing id names (incarnation and notice suffix
    dropped).

    Raises:
        UnicodeDecodeError: the id is not UTF-8.
    """
    return routing.decode().partition(INCARNATION_SEP)[0].removesuffix(NOTICE_SUFFIX)


@dataclass
class Link:
    """The DEALER socket to one neighbour, its monitor, and what the monitor reported."""

    peer: str
    address: str
    socket: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    lost: bool = False
    """Whether the connection dropped since this socket was opened (a round fails on it)."""
    reconnected: bool = False
    """Whether ZeroMQ connected again after the drop. It does so under the same routing id,
    which the neighbour's ROUTER may still hold for the old connection (half-open there: the
    close never arrived; with a cluster key it never hands an id over and drops the new
    connection's frames), so such a link is not used again: its socket is replaced before the
    next round (:meth:`~chaos.collectives.peers.PeerSockets.renew_lost`). A link still down
    keeps failing rounds at once instead."""
    refused: str | None = None
    """Why the last CURVE handshake of this link failed (the neighbour has another cluster
    key), until one succeeds."""


class LanePayload:
    """The payload of a frame read from a lane (see :mod:`chaos.collectives.lanes`): a buffer
    of its own, or a region of the round's result buffer it was read straight into."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


@dataclass
class Frame:
    """One received frame: the sending peer, its decoded header, and the raw parts.

    ``placed`` says the payload was read straight into the round's result buffer, at the
    region its header names (so it needs no copy there).
    """

    peer: str
    header: Header
    raw_header: zmq.Frame | bytes
    payload: zmq.Frame | LanePayload
    placed: bool = False


def send_notice(sock: zmq.Socket, op: Op, key: tuple[int, int], payload: bytes = b"") -> None:
    """Sends a notice: a header and a small payload (``NEWER``, ``BEHIND``: empty; ``LANE``:
    the offer); best effort: without it the peer times out (or keeps ZeroMQ) as it would have
    anyway."""
    header = encode_header(op, torch.float32, 0, key[0], key[1], 0, 0)
    try:
        sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
        sock.send(payload, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


class CaughtUp(Exception):
    """Internal: a neighbour sent the running step's result (see :attr:`Op.RESULT`)."""

    def __init__(self, frame: Frame) -> None:
        super().__init__("caught up")
        self.frame = frame


@dataclass
class Fault:
    """The fault set by ``Communicator.fail_at``: exit in ``step`` after ``after_frames`` sends."""

    step: int
    after_frames: int
    before_exit: Callable[[], None] | None = None
    sent: int = field(default=0)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages of two tensors share (or may share) memory."""
    a0 = a.untyped_storage().data_ptr()
    b0 = b.untyped_storage().data_ptr()
    return a0 == b0 or (a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.untyped_storage().nbytes()
                        and b0 < a0 + a.untyped_storage().nbytes())  # fmt: skip


def result_of(frame: Frame, tensor: torch.Tensor, free_tail: int = 0) -> torch.Tensor:
    """The tensor a RESULT frame carries, checked against the call's input.

    With ``free_tail``, the frame's elements past the input's first ``numel - free_tail`` may
    differ in number (a result kept from an attempt at the step under another membership,
    whose audit digests had a slot per member): the result then takes the frame's first
    elements and zeros for the input's last ``free_tail``.

    Raises:
        ProtocolError: its dtype, size or byte count does not match the input's.
    """
    h = frame.header
    fixed = tensor.numel() - free_tail
    if h.dtype != tensor.dtype or (h.nelem != tensor.numel() and (not free_tail
                                                                   or h.nelem < fixed)):
        raise ProtocolError(f"result frame from {frame.peer} does not match this round")
    raw = frame.payload.buffer
    if len(raw) != h.nelem * tensor.element_size():
        raise ProtocolError(f"result frame from {frame.peer} has {len(raw)} bytes")
    got = torch.frombuffer(bytearray(raw), dtype=h.dtype)
    if h.nelem == tensor.numel():
        return got
    out = torch.zeros(tensor.numel(), dtype=h.dtype)
    out[:fixed] = got[:fixed]
    return out
