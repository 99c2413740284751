"""The policy notices a daemon publishes to its trainers (PUB/SUB on the notify endpoint).

A notice goes out on every change of the installed epoch or of the pause state, with the policy
itself when it is small, and at least every heartbeat interval otherwise, so that a trainer hears
of a change without asking (docs/trainer-daemon-interface.md).
"""

from __future__ import annotations

from chaos.daemon.replies import policy_notice
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.transport import Transport

from chaos.protocol import encode


class PolicyNotices:
    """Publishes the installed epoch and pause state to the local trainers.

    Args:
        ctx: The daemon's context (its facts; timer ``notice``: the next periodic notice).
        transport: Publishes on the notify endpoint.
    """

    def __init__(self, ctx: DaemonContext, transport: Transport) -> None:
        self.ctx = ctx
        self.transport = transport
        self._last: tuple[int, bool] | None = None  # the last (epoch, paused) published

    def publish(self, now: float) -> None:
        """Publishes a notice if the epoch or the pause state changed, or one is due."""
        facts, timers = self.ctx.facts, self.ctx.timers
        notice = (facts.epoch, facts.paused)
        if notice != self._last or timers.is_due("notice", now):
            changed, self._last = notice != self._last, notice
            timers.set("notice", now + facts.cfg.heartbeat_interval_s)
            notice_msg = policy_notice(facts, self.transport.notify_endpoint, changed)
            self.transport.publish(encode(notice_msg))
