"""Where each received frame goes: the running round, a later round, or away.

Internal to :mod:`chaos.collectives`. :class:`Inbox` keeps the frames that came before their
round (``early``, within the bounds of an :class:`~chaos.collectives.early.EarlyBudget`), hands
the running round its own frames, drops older rounds' frames (sending the notices that help
their senders) and frames of epochs too far ahead, and remembers the newest epoch in which a
peer already runs the current step.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from chaos.collectives.config import CollectiveStats
from chaos.collectives.early import EarlyBudget, frame_bytes
from chaos.collectives.frames import Op
from chaos.collectives.links import CaughtUp, Frame
from chaos.collectives.notices import PeerNotices, sort_early
from chaos.errors import PeerFailure

__all__ = ["Inbox", "Neighbours"]

Key = tuple[int, int]


class Neighbours(Protocol):
    """The current neighbours (see :class:`~chaos.collectives.peers.PeerSockets`)."""

    def __contains__(self, peer: object) -> bool:
        """Whether ``peer`` is a neighbour (has a data link)."""
        ...


class Inbox:
    """Sorts the well-formed frames of a communicator by round.

    Args:
        budget: Bounds the frames kept for later rounds (shared with the data endpoint's).
        stats: The communicator's counters (the ``dropped_*`` and ``early_buffered`` ones).
        notices: Sends the notices that help a peer in another round.
        neighbours: The current neighbours (frames of others are dropped).
    """

    def __init__(
        self,
        budget: EarlyBudget,
        stats: CollectiveStats,
        notices: PeerNotices,
        neighbours: Neighbours,
    ) -> None:
        self._budget = budget
        self._early_bytes = 0  # this inbox's part of the budget's held bytes
        self._stats = stats
        self._notices = notices
        self._neighbours = neighbours
        self._early: deque[Frame] = deque()
        self._ready: deque[Frame] = deque()
        self.newer_round: int | None = None
        """The newest epoch in which a peer runs the current round's step, if any (see
        :meth:`Communicator.newer_round_seen
        <chaos.collectives.communicator.Communicator.newer_round_seen>`)."""

    def probe(self, peer: str, key: Key) -> None:
        """Asks ``peer``, quiet for a while in round ``key``, whether it completed that step
        (see :meth:`PeerNotices.probe <chaos.collectives.notices.PeerNotices.probe>`)."""
        self._notices.probe(peer, key)

    def note_newer(self, epoch: int) -> None:
        """Records that the current step runs (also) under the newer epoch ``epoch``."""
        self.newer_round = max(self.newer_round or 0, epoch)

    def drop_older_than(self, epoch: int) -> None:
        """Drops the kept frames of epochs before ``epoch`` (a new topology came), and those
        now too far ahead of it (kept before the first topology)."""
        kept = deque(f for f in self._early if f.header.epoch >= epoch)
        self._stats.dropped_stale += len(self._early) - len(kept)
        self._set_early(deque(f for f in kept if not self._budget.too_far(f.header.epoch, f.peer)))

    def start_round(self, key: Key) -> None:
        """Takes in the frames kept for round ``key`` (see
        :func:`~chaos.collectives.notices.sort_early`) and tells the peers still in an older
        epoch of this step that this node runs it under ``key``."""
        early = sort_early(self._early, key)
        self._ready, self.newer_round = early.ready, early.newer_epoch
        self._set_early(early.later)
        self._stats.dropped_stale += early.stale
        for peer in early.stale_peers:
            self._notices.tell_newer(peer, key)

    def next_ready(self) -> Frame | None:
        """The next kept frame of the running round from a neighbour, or ``None``.

        Raises:
            PeerFailure, CaughtUp: as :meth:`accept`.
        """
        while self._ready:  # frames that came before this round started
            frame = self.accept(self._ready.popleft())
            if frame is not None:
                return frame
        return None

    def route(self, frame: Frame, key: Key) -> Frame | None:
        """Sorts a well-formed frame: this round's (returned), a later round's (kept), an older
        round's (dropped, with the notices that help its sender), or a notice (applied).

        Raises:
            PeerFailure, CaughtUp: as :meth:`accept`.
        """
        peer, header = frame.peer, frame.header
        k = header.key
        if self._budget.too_far(k[0], peer):
            return None  # no honest member is that far ahead: a key holder's frame
        if header.op == Op.NEWER:
            if k[1] == key[1] and k[0] > key[0]:
                self.note_newer(k[0])
            elif k[1] > key[1]:
                self._keep(frame)  # a later step's
            return None
        if header.op == Op.RESULT and k < key:
            self._stats.dropped_stale += 1  # a result passed on to this node, which has it
            return None
        if k[1] == key[1] - 1:
            # the peer still runs the step this node completed: it never got that round's
            # result (a member died while it was going out); send it the kept result
            self._stats.dropped_stale += 1
            self._notices.offer_result(peer, k)
            return None
        if header.op == Op.BEHIND:
            return None  # about a step this node did not just complete
        if k < key:
            self._stats.dropped_stale += 1
            if k[1] == key[1]:
                self._notices.tell_newer(peer, key)
            return None
        if k > key:
            self._keep_later(frame, key)
            return None
        return self.accept(frame)

    def _keep_later(self, frame: Frame, key: Key) -> None:
        """Keeps a frame of a later round than ``key`` for it (or counts it dropped)."""
        k = frame.header.key
        if k[1] == key[1] and k[0] > key[0]:
            # A peer runs this same step under a newer epoch: it never completes (and
            # never will complete) the round we are in, so nobody can; see newer_round.
            self.note_newer(k[0])
        elif k[1] == key[1] + 1:
            # the peer completed our step: this node missed it
            self._notices.ask_result(frame.peer, key)
        if self._keep(frame):
            self._stats.early_buffered += 1

    def _keep(self, frame: Frame) -> bool:
        """Keeps a frame for a later round if the budget admits it (else it is dropped)."""
        nbytes = frame_bytes(frame)
        if not self._budget.admit(frame.header.epoch, nbytes, len(self._early), frame.peer):
            return False
        self._early.append(frame)
        self._early_bytes += nbytes
        return True

    def _set_early(self, early: deque[Frame]) -> None:
        """Replaces the kept frames (what left them is released from the budget)."""
        nbytes = sum(frame_bytes(f) for f in early)
        self._budget.release(self._early_bytes - nbytes)
        self._early, self._early_bytes = early, nbytes

    def accept(self, frame: Frame) -> Frame | None:
        """A frame of the running round: dropped if not from a neighbour; an abort raises.

        Raises:
            PeerFailure: the frame is a neighbour's abort of this round.
            CaughtUp: the frame is a neighbour's kept result of this round.
        """
        if frame.peer not in self._neighbours:
            self._stats.dropped_unknown_peer += 1
            return None
        if frame.header.op == Op.ABORT:
            failed = frame.payload.bytes.decode(errors="replace")[:64] or frame.peer
            raise PeerFailure(failed, "aborted by a neighbour", reported_by=frame.peer)
        if frame.header.op == Op.RESULT:
            raise CaughtUp(frame)
        return frame
