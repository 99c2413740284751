"""The bound on the frames a communicator holds for a later round.

Internal to :mod:`chaos.collectives`. Two places keep frames that came before their round:

* :class:`~chaos.collectives.peers.PeerSockets` holds a frame of a later epoch whose
  connection's key the installed topology does not name for its sender (a joiner, a member that
  restarted with a new key) until that epoch's topology vouches for it or refutes it;
* :class:`~chaos.collectives.inbox.Inbox` keeps a vouched frame of a later ``(epoch, step)``
  until its round starts.

Anyone who holds the cluster key can send frames of any epoch, so both draw on one
:class:`EarlyBudget`: at most :attr:`CommunicatorConfig.max_early_bytes
<chaos.collectives.config.CommunicatorConfig.max_early_bytes>` in all, and none of an epoch more
than :attr:`~chaos.collectives.config.CommunicatorConfig.max_early_epochs` ahead of the
installed topology's (an honest member is one or two epochs ahead: it rebuilt first). A frame
refused is dropped and counted (:class:`~chaos.collectives.config.CollectiveStats`
``dropped_early_far``, ``dropped_early_bytes``, ``dropped_early_overflow``); the first few of
each kind are logged.
"""

from __future__ import annotations

import logging

import zmq

from chaos.collectives.config import CollectiveStats, CommunicatorConfig
from chaos.collectives.links import Frame, LanePayload

__all__ = ["EarlyBudget", "frame_bytes", "parts_bytes"]

log = logging.getLogger("chaos.collectives")

LOGGED_PER_KIND = 3
"""Drops of each kind that are logged; later ones are only counted."""


def frame_bytes(frame: Frame) -> int:
    """The bytes a kept frame holds (its header and payload)."""
    payload = frame.payload
    size = payload.buffer.nbytes if isinstance(payload, LanePayload) else len(payload)
    return len(frame.raw_header) + size


def parts_bytes(parts: list[zmq.Frame]) -> int:
    """The bytes a received message's parts hold."""
    return sum(len(p) for p in parts)


class EarlyBudget:
    """The bytes, count and epoch bounds shared by the places that keep early frames.

    Args:
        config: The communicator's settings (``max_early_bytes``, ``max_early_epochs``,
            ``max_early_frames``).
        stats: The communicator's counters (the ``dropped_early_*`` ones).
    """

    def __init__(self, config: CommunicatorConfig, stats: CollectiveStats) -> None:
        self._node_id = config.node_id
        self._max_bytes = config.max_early_bytes
        self._max_epochs = config.max_early_epochs
        self._max_frames = config.max_early_frames
        self._stats = stats
        self._logged: dict[str, int] = {}
        self.epoch = -1
        """The installed topology's epoch (``-1`` before the first: no epoch bound yet)."""
        self.held_bytes = 0
        """The bytes of the frames kept now, in all places."""

    def too_far(self, epoch: int, sender: str) -> bool:
        """Whether a frame of ``epoch`` is too far ahead to keep (then it is counted and, the
        first few times, logged)."""
        if self.epoch < 0 or epoch <= self.epoch + self._max_epochs:
            return False
        self._stats.dropped_early_far += 1
        self._warn("far", sender, f"its epoch {epoch} is more than max_early_epochs="
                   f"{self._max_epochs} ahead of this node's {self.epoch}")  # fmt: skip
        return True

    def admit(self, epoch: int, nbytes: int, held_frames: int, sender: str) -> bool:
        """Whether a frame of ``epoch`` and ``nbytes`` may be kept by a place that keeps
        ``held_frames`` now; if so its bytes count until :meth:`release`. A refused one is
        counted and, the first few times, logged."""
        if self.too_far(epoch, sender):
            return False
        if held_frames >= self._max_frames:
            self._stats.dropped_early_overflow += 1
            self._warn("count", sender, f"{held_frames} frames are held already "
                       f"(max_early_frames={self._max_frames})")  # fmt: skip
            return False
        if self.held_bytes + nbytes > self._max_bytes:
            self._stats.dropped_early_bytes += 1
            self._warn("bytes", sender, f"its {nbytes} bytes and the {self.held_bytes} held "
                       f"already exceed max_early_bytes={self._max_bytes}")  # fmt: skip
            return False
        self.held_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Frees the bytes of frames no longer kept (handed on or dropped)."""
        self.held_bytes = max(0, self.held_bytes - nbytes)

    def _warn(self, kind: str, sender: str, why: str) -> None:
        n = self._logged.get(kind, 0)
        if n >= LOGGED_PER_KIND:
            return
        self._logged[kind] = n + 1
        log.warning(
            "%s: dropped a frame from %r held for a later round: %s%s", self._node_id, sender,
            why, "" if n + 1 < LOGGED_PER_KIND else " (further such drops are only counted)",
        )  # fmt: skip
