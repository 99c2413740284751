"""Inbound frames: validated with :func:`chaos.protocol.validate`, then routed by message type.

:class:`Dispatcher` holds the validation context (rebuilt only when something it holds may have
changed), refuses what does not validate, drops what a fault blocks, and calls the one handler
registered for the message's type. A handler that raises is logged (event ``handler_error``):
a bug must not take the control plane down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from chaos.daemon.config import DaemonConfig
from chaos.daemon.events import EventLog
from chaos.daemon.facts import MemberFacts
from chaos.daemon.metrics import Metrics
from chaos.daemon.peer_auth import sender_refusal
from chaos.daemon.states import DaemonState, Role
from chaos.daemon.transport import FaultInjector, Inbound, ReplyPath, Transport

from chaos.protocol import (
    ClusterView,
    Message,
    Reason,
    Rejected,
    ValidationContext,
    encode,
    refusal,
    tag_of,
    validate,
)

log = logging.getLogger("chaos.daemon")

Handler = Callable[[Any, ReplyPath | None, float], None]
"""A message handler: ``(message, reply path or None for a local message, monotonic now)``."""


class ValidationSource(MemberFacts, Protocol):
    """What the validation context is built from."""

    cfg: DaemonConfig

    @property
    def view(self) -> ClusterView | None: ...  # noqa: D102

    @property
    def role(self) -> Role: ...  # noqa: D102

    @property
    def is_scheduler(self) -> bool: ...  # noqa: D102

    @property
    def membership_version(self) -> object:
        """Changes whenever the scheduler's membership may have (``None`` on a member)."""

    def members(self) -> list[str]: ...  # noqa: D102


class Dispatcher:
    """Validates inbound frames and hands each message to its handler.

    Args:
        source: The daemon's state the validation context is built from.
        transport: Where refusals go back.
        faults: The injected faults (a blocked sender's frames are dropped).
        metrics: Counts messages and refusals.
        events: The event log (``handler_error``).
    """

    def __init__(
        self,
        source: ValidationSource,
        transport: Transport,
        faults: FaultInjector,
        metrics: Metrics,
        events: EventLog,
    ) -> None:
        self.source = source
        self.transport = transport
        self.faults = faults
        self.metrics = metrics
        self.events = events
        self.handlers: dict[type, Handler] = {}
        self.refused = 0
        self._ctx: tuple[tuple[object, ...], ValidationContext] | None = None

    def register(self, handlers: dict[type, Handler]) -> None:
        """Adds handlers by message type."""
        self.handlers.update(handlers)

    def context(self) -> ValidationContext:
        """The validation context, rebuilt only when something it holds may have changed."""
        s = self.source
        key = (
            s.epoch,
            s.term,
            s.role,
            s.state,
            s.paused,
            s.membership_version,
            s.view,  # compared by identity first: a new view is a new object
        )
        if self._ctx is not None and self._ctx[0] == key:
            return self._ctx[1]
        ctx = ValidationContext(
            max_frame_bytes=s.cfg.max_frame_bytes,
            epoch=s.epoch,
            term=s.term,
            members=frozenset(s.members()),
            is_scheduler=s.is_scheduler,
            paused=s.paused,
            joining=s.state == DaemonState.JOINING,
            node_id=s.node_id,
        )
        self._ctx = (key, ctx)
        return ctx

    def on_frame(self, inbound: Inbound, now: float) -> None:
        """Validates one inbound frame and dispatches its message (or refuses it)."""
        ctx = self.context()
        if inbound.frame is None:
            result: Message | Rejected = Rejected(
                refusal(Reason.MALFORMED, ctx, "expected one payload frame (and an attachment)")
            )
        else:
            result = validate(inbound.frame, ctx, inbound.attachment)
        if isinstance(result, Rejected):
            self.refused += 1
            self.metrics.refused(result.refusal.reason)
            log.debug("refused %s: %s", result.refusal.reason, result.refusal.detail)
            self.transport.reply(inbound.reply, encode(result.refusal))
            return
        if self.faults.blocks_in(result.sender):
            self.faults.dropped += 1
            return
        forged = sender_refusal(result, inbound.peer_key, self.source.view)
        if forged is not None:
            self.refused += 1
            self.metrics.refused(Reason.NOT_AUTHENTICATED)
            log.warning("refused %s from %r: %s", tag_of(result), result.sender, forged)
            self.events.emit("refused_sender", type=tag_of(result), sender=result.sender,
                             detail=forged)  # fmt: skip
            no = refusal(Reason.NOT_AUTHENTICATED, ctx, forged, tag_of(result))
            self.transport.reply(inbound.reply, encode(no))
            return
        self.metrics.message(tag_of(result))
        self.dispatch(result, inbound.reply, now)

    def dispatch(self, msg: Message, reply: ReplyPath | None, now: float) -> None:
        """Calls the handler of ``msg``'s type (none: ignored)."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            return
        try:
            handler(msg, reply, now)
        except Exception as exc:  # a bug must not take the control plane down
            log.exception("handler for %s failed", tag_of(msg))
            self.events.emit("handler_error", type=tag_of(msg), error=repr(exc)[:300])
