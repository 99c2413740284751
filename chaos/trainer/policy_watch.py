"""The trainer's side of the daemon's policy notices: is there a newer policy to fetch?

At every step boundary a trainer must take a newer policy if its daemon has one. Asking the
daemon each time is an IPC round trip that, on a busy device, waits for the daemon to be
scheduled, and it wakes the daemon for nothing at almost every step. Instead the daemon
publishes a :class:`~chaos.protocol.PolicyNotice` (its installed epoch) whenever the epoch or its
pause state changes, and at least every ``interval_s``; the trainer drains these without
blocking and asks only when a notice names a newer epoch.

The notice of a change carries the policy itself when it is small, so the trainer installs it
without a round trip to a daemon that is busy committing (:meth:`PolicyWatch.carried`). Whenever
the watch cannot vouch for the notices (no notice heard yet, the notifier silent for longer than
it promised, or a frame it cannot decode), :meth:`PolicyWatch.needs_fetch` answers ``True`` and
the trainer asks as before.
"""

from __future__ import annotations

import logging
import time

import zmq

from chaos.errors import ProtocolError
from chaos.protocol import DEFAULT_MAX_FRAME_BYTES, PolicyNotice, PolicyReply, decode

__all__ = ["PolicyWatch"]

log = logging.getLogger("chaos.trainer.policy_watch")

SILENCE_FACTOR = 3.0
"""The notifier counts as silent after this many of its promised intervals without a notice."""
_DRAIN_MAX = 256


class PolicyWatch:
    """Subscribes to a daemon's policy notices.

    Args:
        address: The daemon's ``PolicyReply.notify_address``.
        max_frame_bytes: Notices longer than this are ignored.

    Raises:
        zmq.ZMQError: the address cannot be connected to.
    """

    def __init__(self, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 1024)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address)
        self._max = max_frame_bytes
        self.latest_epoch = -1
        self.paused = False
        self._heard_at: float | None = None
        self._policy: PolicyReply | None = None
        self._interval_s = 0.0
        self.ignored = 0

    def needs_fetch(self, installed_epoch: int, now: float) -> bool:
        """Drains the notices that arrived; whether the trainer must ask its daemon now.

        Args:
            installed_epoch: The epoch of the policy the trainer runs.
            now: ``time.monotonic()``.

        Returns:
            ``True`` when a notice named a newer epoch or the daemon is paused, or when the
            notices cannot be relied on (none yet, or silent for over ``SILENCE_FACTOR``
            promised intervals).
        """
        for _ in range(_DRAIN_MAX):
            try:
                frame = self._sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._take(frame, now)
        if self._heard_at is None or now - self._heard_at > SILENCE_FACTOR * self._interval_s:
            return True
        return self.paused or self.latest_epoch > installed_epoch

    def heard(self, reply: PolicyReply, now: float) -> None:
        """Counts the answer that gave this watch its address as a notice of its epoch.

        A new watch has heard no notice: until the daemon's next periodic one (up to
        ``notify_interval_s`` away, since the subscription misses what was published before
        it connected) :meth:`needs_fetch` would make the trainer ask at every step boundary.
        The answer says as much as a notice. A notice of a change published between it and the
        subscription is still caught: the periodic notices name the epoch, and a peer already
        in it tells this node (NEWER). If no notice ever comes, the watch is silent after
        ``SILENCE_FACTOR`` intervals and the trainer asks at every boundary, as before.

        Args:
            reply: The daemon's answer to a policy request.
            now: ``time.monotonic()`` when it came.
        """
        if reply.notify_interval_s <= 0:
            return  # a daemon that does not say how often it notifies: ask until a notice
        self.latest_epoch = max(self.latest_epoch, reply.epoch)
        self.paused = reply.paused
        self._interval_s = reply.notify_interval_s
        self._heard_at = now

    def _take(self, frame: bytes, now: float) -> None:
        try:
            msg = decode(frame, self._max)
        except ProtocolError as exc:
            self.ignored += 1
            log.debug("policy notice ignored: %s", exc)
            return
        if not isinstance(msg, PolicyNotice):
            self.ignored += 1
            return
        self.latest_epoch = msg.epoch
        if msg.policy is not None and msg.policy.epoch == msg.epoch:
            self._policy = msg.policy
        elif self._policy is not None and self._policy.epoch != msg.epoch:
            self._policy = None  # a newer epoch whose notice carried no policy: ask for it
        self.paused = msg.paused
        self._interval_s = msg.interval_s
        self._heard_at = now

    def carried(self, installed_epoch: int) -> PolicyReply | None:
        """The policy the latest notice carried, if it is newer than ``installed_epoch`` and the
        daemon is not paused (call right after :meth:`needs_fetch`); ``None``: ask."""
        p = self._policy
        if p is None or self.paused or p.paused or p.epoch <= installed_epoch:
            return None
        return p

    def restart(self, installed_epoch: int) -> PolicyReply | None:
        """Drains the notices; the policy the latest one carried if it is newer than
        ``installed_epoch`` and restarts the allreduce (``restart_allreduce``), else ``None``.

        Never blocks: a trainer calls it while waiting in an allreduce, to give up a round that
        the daemon has declared lost (a link found down, a failed step).
        """
        self.needs_fetch(installed_epoch, time.monotonic())
        p = self.carried(installed_epoch)
        return p if p is not None and p.restart_allreduce else None

    def close(self) -> None:
        """Closes the SUB socket and its context."""
        self._sock.close(linger=0)
        self._ctx.term()
