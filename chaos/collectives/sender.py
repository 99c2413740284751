"""How a communicator's data frames leave: over a payload lane or through ZeroMQ, zero-copy.

Internal to :mod:`chaos.collectives`. :class:`Sender` also carries the named fault of
:meth:`Communicator.fail_at <chaos.collectives.communicator.Communicator.fail_at>`, which
counts the data frames sent.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import zmq

from chaos.collectives.config import CollectiveStats
from chaos.collectives.lane_switch import LaneSwitch
from chaos.collectives.links import Fault, LanePayload
from chaos.collectives.peers import PeerSockets
from chaos.errors import PeerFailure, PeerTimeout

__all__ = ["Sender"]

_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_NOBLOCK = int(zmq.NOBLOCK)


def _nbytes(part: bytes | zmq.Frame | memoryview | LanePayload) -> int:
    """The bytes of one part of a data frame."""
    if isinstance(part, LanePayload):
        return part.buffer.nbytes
    if isinstance(part, memoryview):
        return part.nbytes
    return len(part)


class Sender:
    """Sends the data frames of the running round to the neighbours.

    Args:
        peers: The links.
        lanes: The payload lanes (used when the round's tensor is large enough).
        stats: The communicator's counters (``lane_frames_sent``, ``data_bytes_sent``).
    """

    def __init__(self, peers: PeerSockets, lanes: LaneSwitch, stats: CollectiveStats) -> None:
        self._peers = peers
        self._lanes = lanes
        self._stats = stats
        self._fault: Fault | None = None
        self._lose: tuple[str, int] | None = None  # (peer, step) whose frames are lost
        self.step = -1
        """The running (or last) round's step (the fault is counted in its step only)."""

    def fail_at(self, step: int, after_frames: int, before_exit: Callable[[], None] | None) -> None:
        """Arms the fault: exit during ``step`` once ``after_frames`` data frames are sent."""
        self._fault = Fault(step, after_frames, before_exit)

    def lose_frames_to(self, peer: str, step: int) -> None:
        """Arms the lossy-link fault: the data frames of ``step`` to ``peer`` are not sent."""
        self._lose = (peer, step)

    def send(
        self,
        peer: str,
        header: bytes | zmq.Frame,
        payload: zmq.Frame | memoryview | LanePayload,
        *,
        track: bool = False,
    ) -> zmq.MessageTracker | None:
        """Sends one data frame; see :meth:`Communicator.send
        <chaos.collectives.communicator.Communicator.send>`.

        Raises:
            PeerTimeout: the link's queue stayed full for the whole timeout.
            PeerFailure: no link to ``peer``.
        """
        link = self._peers.link(peer)
        if link is None:
            raise PeerFailure(peer, "no link to this peer in the current topology")
        if self._lose is not None and self._lose == (peer, self.step):
            self._stats.frames_lost_by_fault += 1
            return None
        if self._lanes.send(link.socket, peer, header, payload):
            self._stats.lane_frames_sent += 1
            self._stats.data_bytes_sent += _nbytes(header) + _nbytes(payload)
            if self._fault is not None:
                self._count_fault()
            return None
        try:
            link.socket.send(header, _MORE_NOBLOCK, copy=True)
            if isinstance(payload, LanePayload):  # it may lie in the result: copy, untracked
                tracker = link.socket.send(payload.buffer, _NOBLOCK, copy=True)
            else:
                tracker = link.socket.send(payload, _NOBLOCK, copy=False, track=track)
        except zmq.Again:
            raise PeerTimeout(peer, "send queue full") from None
        self._stats.data_bytes_sent += _nbytes(header) + _nbytes(payload)
        if self._fault is not None:
            self._count_fault()
        return tracker if track else None

    def _count_fault(self) -> None:
        fault = self._fault
        if fault is None or self.step != fault.step:
            return
        fault.sent += 1
        if fault.sent > fault.after_frames:
            if fault.before_exit is not None:
                fault.before_exit()
            os._exit(70)
