"""The policy notices a daemon publishes to its trainers (PUB/SUB on the notify endpoint).

A notice goes out on every change of the installed epoch or of the pause state, with the policy
itself when it is small, and at least every heartbeat interval otherwise, so that a trainer hears
of a change without asking (docs/trainer-daemon-interface.md).
"""

from __future__ import annotations

from chaos.daemon.replies import ReplySource, policy_notice
from chaos.daemon.timers import Timers
from chaos.daemon.transport import Transport

from chaos.protocol import encode


class PolicyNotices:
    """Publishes the installed epoch and pause state to the local trainers.

    Args:
        source: What the notice shows of the daemon.
        transport: Publishes on the notify endpoint.
        timers: The loop's timers (timer ``notice``: the next periodic notice).
    """

    def __init__(self, source: ReplySource, transport: Transport, timers: Timers) -> None:
        self.source = source
        self.transport = transport
        self.timers = timers
        self._last: tuple[int, bool] | None = None  # the last (epoch, paused) published

    def publish(self, now: float) -> None:
        """Publishes a notice if the epoch or the pause state changed, or one is due."""
        notice = (self.source.epoch, self.source.paused)
        if notice != self._last or self.timers.is_due("notice", now):
            changed, self._last = notice != self._last, notice
            self.timers.set("notice", now + self.source.cfg.heartbeat_interval_s)
            self.transport.publish(encode(policy_notice(self.source, with_policy=changed)))
