"""The receive loop of a communicator: polling with a timeout, failures and interrupts.

Internal to :mod:`chaos.collectives`. :class:`Receiver` waits for the running round's next
frame on the data endpoint and the payload lanes, in poll slices, and between slices checks the
neighbours' connections, the peers reported dead and the outside interrupt
(:class:`Interrupt`). What each frame is for is the :class:`~chaos.collectives.inbox.Inbox`'s
business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from chaos.collectives.config import CollectiveStats, CommunicatorConfig
from chaos.collectives.frames import Op, decode_header
from chaos.collectives.inbox import Inbox
from chaos.collectives.lane_switch import LaneSwitch
from chaos.collectives.lanes import InLane, Place, read_frame
from chaos.collectives.links import Frame, member_of
from chaos.collectives.peers import PeerSockets
from chaos.errors import PeerTimeout, ProtocolError, RoundInterrupted

__all__ = ["Interrupt", "Receiver"]

log = logging.getLogger("chaos.collectives")


class Interrupt:
    """An outside condition that aborts a blocked allreduce, checked at most every ``every_s``.

    Args:
        node_id: This node's id (reported with the interrupt).
    """

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._check: Callable[[], str | None] | None = None
        self._every_s = 0.05
        self._next_check = 0.0

    def set(self, check: Callable[[], str | None] | None, every_s: float) -> None:
        """Sets (or, with ``None``, removes) the condition; see :meth:`Communicator.set_interrupt
        <chaos.collectives.communicator.Communicator.set_interrupt>`.

        Raises:
            ValueError: ``every_s`` is not positive.
        """
        if not every_s > 0:
            raise ValueError("every_s must be > 0")
        self._check = check
        self._every_s = float(every_s)

    def poll(self) -> None:
        """Calls the condition, if it is due.

        Raises:
            RoundInterrupted: the condition returned a reason.
        """
        if self._check is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self._every_s
        reason = self._check()
        if reason:
            raise RoundInterrupted(reason, reported_by=self._node_id)


class Receiver:
    """Receives the running round's frames.

    Args:
        config: The communicator's settings (``poll_slice_s``, ``chunk_bytes``).
        stats: The communicator's counters.
        peers: The data endpoint and the links.
        lanes: The payload lanes.
        inbox: Sorts the well-formed frames by round.
        interrupt: The outside condition checked between poll slices.
    """

    def __init__(
        self,
        config: CommunicatorConfig,
        stats: CollectiveStats,
        peers: PeerSockets,
        lanes: LaneSwitch,
        inbox: Inbox,
        interrupt: Interrupt,
    ) -> None:
        self._config = config
        self._me = config.node_id
        self._stats = stats
        self._peers = peers
        self._lanes = lanes
        self._inbox = inbox
        self._interrupt = interrupt

    def recv(
        self,
        key: tuple[int, int],
        timeout_s: float,
        waiting_for: str | Callable[[], str],
        place: Place | None = None,
    ) -> Frame:
        """The next frame of ``key`` from a neighbour; see :meth:`Communicator.recv
        <chaos.collectives.communicator.Communicator.recv>`.

        Raises:
            PeerFailure: a neighbour's connection dropped, was reported dead, or sent an abort.
            PeerTimeout: nothing arrived within ``timeout_s``.
        """
        early = self._inbox.next_ready()
        if early is not None:
            return early
        # the monitors first, once per receive (each poll then reads the ones with events): a
        # connection that dropped and came back since the last poll (between rounds, say)
        # must not fail this round on the stale drop
        self._peers.drain_monitors()
        deadline = time.monotonic() + timeout_s
        probe_at = time.monotonic() + self._config.quiet_probe_s
        while True:
            try:
                parts = self._peers.recv_nowait()
            except zmq.Again:
                now = time.monotonic()
                if now >= probe_at:  # quiet for a while: did that neighbour finish the step?
                    probe_at = now + self._config.quiet_probe_s
                    self._inbox.probe(_peer_of(waiting_for), key)
                lane = self._wait(deadline, waiting_for)
                if lane is not None:
                    frame = self._read_lane(lane, key, timeout_s, place)
                    if frame is not None:
                        return frame
                continue
            frame = self._classify(parts, key)
            if frame is not None:
                return frame

    def _wait(self, deadline: float, waiting_for: str | Callable[[], str]) -> InLane | None:
        """Polls until something arrives (or a slice passes); a readable lane is returned."""
        self._peers.check_failed()
        left = deadline - time.monotonic()
        if left <= 0:
            peer = waiting_for if isinstance(waiting_for, str) else waiting_for()
            raise PeerTimeout(peer, "no frame within the timeout", reported_by=self._me)
        self._lanes.before_poll(self._peers.socket, self._peers.poller)
        events = self._peers.poll(max(1, int(min(left, self._config.poll_slice_s) * 1000)))
        lane = self._lanes.on_readable(events)
        self._peers.check_failed()
        self._interrupt.poll()
        return lane

    def _read_lane(
        self, lane: InLane, key: tuple[int, int], timeout_s: float, place: Place | None
    ) -> Frame | None:
        """Reads one frame from a readable lane (see :func:`~chaos.collectives.lanes.read_frame`).

        A malformed header, or a stream that ends, closes the lane (the neighbour is offered a
        new one at the next round; a peer that died is noticed on ZeroMQ).

        Raises:
            PeerTimeout: the stream stopped in the middle of a frame.
            PeerFailure: a neighbour was reported dead or disconnected, or the round was
                interrupted, while the frame was being read.
        """
        deadline = time.monotonic() + timeout_s
        try:
            got = read_frame(lane, key, deadline, self._config.poll_slice_s, place,
                             self._config.chunk_bytes, self._between_slices)  # fmt: skip
        except BaseException:
            self._lanes.close_incoming(lane.peer)  # a frame read halfway: the stream is cut
            raise
        if isinstance(got, Frame):
            self._stats.frames_received += 1
            self._stats.lane_frames_received += 1
            self._stats.lane_frames_placed += got.placed
            return self._inbox.route(got, key)
        self._lanes.close_incoming(lane.peer)
        if got == "timeout":
            raise PeerTimeout(lane.peer, "a frame stopped halfway", reported_by=self._me)
        if got != "closed":
            log.warning("lane from %s closed: %s", lane.peer, got)
            self._stats.dropped_malformed += 1
        return None  # the stream ended: a failure shows on ZeroMQ

    def _between_slices(self) -> None:
        """While a lane frame is read: the checks a poll slice makes (a peer reported dead or
        disconnected, an interrupt).

        Raises:
            PeerFailure: as :meth:`recv`.
        """
        self._peers.drain_monitors()
        self._peers.check_failed()
        self._interrupt.poll()

    def _classify(self, parts: list[zmq.Frame], key: tuple[int, int]) -> Frame | None:
        """A message from the data endpoint: a frame for the inbox, or a lane offer."""
        self._stats.frames_received += 1
        if len(parts) != 3:
            self._stats.dropped_malformed += 1
            return None
        try:
            # a socket's id is the member's with an incarnation (and a notice socket's with a
            # suffix), authenticated as the member
            peer = member_of(parts[0].bytes)
            header = decode_header(parts[1].buffer)
        except (ProtocolError, UnicodeDecodeError):
            self._stats.dropped_malformed += 1
            return None
        if header.op == Op.LANE:
            link = self._peers.link(peer)
            address = None if link is None else link.address
            if not self._lanes.on_offer(peer, address, parts[2].buffer):
                self._stats.dropped_malformed += 1
            return None
        return self._inbox.route(Frame(peer, header, parts[1], parts[2]), key)


def _peer_of(waiting_for: str | Callable[[], str]) -> str:
    """The neighbour a receive waits for."""
    return waiting_for if isinstance(waiting_for, str) else waiting_for()
