"""Inbound frames: validated with :func:`chaos.protocol.validate`, then routed by message type.

:class:`Dispatcher` holds the validation context (rebuilt only when something it holds may have
changed), refuses what does not validate, drops what a fault blocks, refuses what the connection
may not ask (:func:`client_permission`) or what a budget no longer allows (the join rate), and
calls the one handler registered for the message's type. A handler that raises is logged at
ERROR with its traceback, counted (``chaos_internal_errors_total{where="handler"}``) and written
as the event ``handler_error``: a bug must not take the control plane down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_args

from chaos.daemon.config import DaemonConfig
from chaos.daemon.peer_auth import sender_refusal
from chaos.daemon.states import DaemonState
from chaos.daemon.transport import FaultInjector, Inbound, ReplyPath, Transport

from chaos.errors import ChaosError
from chaos.protocol import (
    FaultCommand,
    JoinRequest,
    LeaveCommand,
    LinkCommand,
    Message,
    Reason,
    Refusal,
    Rejected,
    ValidationContext,
    encode,
    kind_of,
    refusal,
    tag_of,
    validate,
)

if TYPE_CHECKING:
    from chaos.daemon.scheduler.role import DaemonContext, DaemonFacts, SchedulerRole

log = logging.getLogger("chaos.daemon")

REFUSAL_RECORDS_FIRST = 5
"""Refused messages of one kind (forged sender, forbidden command) logged and recorded as an
event one by one; after these, one record every :data:`REFUSAL_RECORDS_EVERY`, with the count."""
REFUSAL_RECORDS_EVERY = 1000

Handler = Callable[[Any, ReplyPath | None, float], None]
"""A message handler: ``(message, reply path or None for a local message, monotonic now)``."""

CLIENT_ONLY: tuple[type, ...] = tuple(t for t in get_args(Message) if t.TO_CLIENT)
"""The answers only a client takes (``TO_CLIENT`` in their schema): a daemon has no handler for
them (and drops them)."""

OPERATOR_COMMANDS: tuple[type, ...] = (LeaveCommand, LinkCommand, FaultCommand)
"""Client commands that change the cluster: accepted on the local IPC socket, and over TCP only
from a key holder when the daemon allows it (see :func:`client_permission`)."""


def client_permission(
    msg: Message, local: bool, peer_key: str | None, remote_operator: bool = False
) -> str | None:
    """Who may ask what (``docs/daemon.md``, "Who may do what").

    * The local IPC socket (in the private run directory: only this user reaches it) may ask
      anything.
    * Over TCP, ``leave``, ``link`` and ``fault`` need ``remote_operator``
      (``--allow-remote-operator``, which needs a cluster key) and a connection authenticated
      with the cluster key (``peer_key`` set). Anything else (``status``, peer messages) is
      open to the protocol's own checks: a key holder that is not a member can join, and
      nothing more.

    ``fault`` also needs ``enable_fault_injection``; that is checked where it is handled.

    Args:
        msg: A validated message.
        local: Whether it came in on the IPC socket.
        peer_key: The connection's CURVE public key (``None``: not authenticated).
        remote_operator: Whether this daemon accepts operator commands over TCP.

    Returns:
        ``None`` when allowed, else why not.
    """
    if local or not isinstance(msg, OPERATOR_COMMANDS):
        return None
    if peer_key is not None and remote_operator:
        return None
    if peer_key is None:
        return (
            f"{tag_of(msg)} is accepted only on the local IPC socket (or over TCP from a "
            "cluster key holder, when the daemon allows it); this TCP connection is not "
            "authenticated"
        )
    return (
        f"{tag_of(msg)} is accepted only on the local IPC socket: this daemon does not take "
        "operator commands over TCP (start it with --allow-remote-operator to let every "
        "cluster key holder send them)"
    )


def fault_permission(cfg: DaemonConfig) -> str | None:
    """Why a ``fault`` command is refused (``None``: fault injection is enabled)."""
    if cfg.enable_fault_injection:
        return None
    return "fault injection is off (start the daemon with --enable-fault-injection)"


class TokenBucket:
    """A rate limit: ``rate_per_s`` on average, ``burst`` at once.

    Args:
        rate_per_s: Tokens added per second.
        burst: The most tokens held (and the tokens at start).
    """

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        """Takes one token at monotonic time ``now``; ``False`` when none is left."""
        if self._at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Dispatcher:
    """Validates inbound frames and hands each message to its handler.

    Args:
        ctx: The daemon's context: the validation context is built from its facts; its metrics
            count messages and refusals; its event log takes ``handler_error``.
        transport: Where refusals go back.
        faults: The injected faults (a blocked sender's frames are dropped).
    """

    def __init__(self, ctx: DaemonContext, transport: Transport, faults: FaultInjector) -> None:
        self.source = ctx.facts
        self.transport = transport
        self.faults = faults
        self.metrics = ctx.metrics
        self.events = ctx.events
        self.handlers: dict[type, Handler] = {}
        self.refused = 0
        self.errors = 0
        """Handler (and dispatch) exceptions survived so far."""
        self._ctx: tuple[tuple[object, ...], ValidationContext] | None = None
        cfg = ctx.cfg
        self._joins = TokenBucket(cfg.join_rate_per_s, cfg.join_burst)
        self._overloaded = 0
        self._refusal_counts: dict[str, int] = {}

    def register(self, handlers: dict[type, Handler]) -> None:
        """Adds handlers by message type."""
        self.handlers.update(handlers)

    def context(self) -> ValidationContext:
        """The validation context, rebuilt only when something it holds may have changed."""
        s = self.source
        key = (
            s.epoch,
            s.term,
            s.election.role,
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
        """Validates one inbound frame and dispatches its message (or refuses it).

        Never raises: an unexpected exception is logged, counted and written as an event.
        """
        try:
            self._on_frame(inbound, now)
        except Exception as exc:  # a bug must not take the control plane down
            self._failed("dispatch", "frame", exc)

    def _refuse(self, inbound: Inbound, no: Refusal) -> None:
        self.refused += 1
        self.metrics.refused(no.reason)
        self.transport.reply(inbound.reply, encode(no))

    def _on_frame(self, inbound: Inbound, now: float) -> None:
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
            self._record_refusal("refused_sender", f"refused {tag_of(result)} from "
                                 f"{result.sender!r}: {forged}", type=tag_of(result),
                                 sender=result.sender, detail=forged)  # fmt: skip
            no = refusal(Reason.NOT_AUTHENTICATED, ctx, forged, tag_of(result))
            self.transport.reply(inbound.reply, encode(no))
            return
        if inbound.peer_key is not None and kind_of(result)[0] in ("command", "scheduler"):
            unverified = self.source.scheduler_problem(result)
            if unverified is not None:  # dropped unanswered: a refusal per heartbeat would
                self.refused += 1  # flood the true scheduler's event log while a view lags
                self.metrics.refused(Reason.UNVERIFIED_SCHEDULER)
                self._record_refusal("refused_scheduler", f"refused {tag_of(result)} from "
                                     f"{result.sender!r}: {unverified}", type=tag_of(result),
                                     sender=result.sender, detail=unverified)  # fmt: skip
                return
        local = inbound.reply.local or inbound.reply.socket is self.transport.ipc
        why = client_permission(result, local, inbound.peer_key,
                                self.source.cfg.allow_remote_operator)  # fmt: skip
        if why is None and isinstance(result, FaultCommand):
            why = fault_permission(self.source.cfg)
        if why is not None:
            self._record_refusal("refused_command", f"refused {tag_of(result)}: {why}",
                                 type=tag_of(result), detail=why)  # fmt: skip
            self._refuse(inbound, refusal(Reason.FORBIDDEN, ctx, why, tag_of(result)))
            return
        if isinstance(result, JoinRequest) and not local and not self._joins.take(now):
            self._overloaded += 1
            if self._overloaded == 1 or self._overloaded % 100 == 0:
                log.warning("join rate exceeded: %d join requests refused so far", self._overloaded)
                self.events.emit("overloaded", budget="join_rate", refused=self._overloaded)
            detail = f"more than {self.source.cfg.join_rate_per_s:g} joins per second"
            self._refuse(inbound, refusal(Reason.OVERLOADED, ctx, detail, tag_of(result)))
            return
        self.metrics.message(tag_of(result))
        self.dispatch(result, inbound.reply, now)

    def _record_refusal(self, name: str, line: str, **fields: object) -> None:
        """Logs and records a refused message: the first :data:`REFUSAL_RECORDS_FIRST` of each
        kind one by one, then one every :data:`REFUSAL_RECORDS_EVERY` with the count so far (a
        key holder's flood of forged messages must not grow the log and the event file
        without bound)."""
        n = self._refusal_counts.get(name, 0) + 1
        self._refusal_counts[name] = n
        if n > REFUSAL_RECORDS_FIRST and n % REFUSAL_RECORDS_EVERY:
            return
        log.warning("%s (%d %s so far)", line, n, name)
        self.events.emit(name, count=n, **fields)

    def dispatch(self, msg: Message, reply: ReplyPath | None, now: float) -> None:
        """Calls the handler of ``msg``'s type (none: a message only a client takes, such as a
        ``status_reply``, which a daemon drops)."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.debug("dropped %s from %s: a daemon does not take it", tag_of(msg), msg.sender)
            return
        try:
            handler(msg, reply, now)
        except Exception as exc:  # a bug must not take the control plane down
            self._failed("handler", tag_of(msg), exc)

    def _failed(self, where: str, what: str, exc: BaseException) -> None:
        """Logs (ERROR, with the traceback), counts and records an exception survived."""
        self.errors += 1
        log.exception("%s for %s failed", where, what)
        try:
            self.metrics.error(where)
            self.events.emit(f"{where}_error", type=what, error=repr(exc)[:300])
        except Exception:  # noqa: BLE001 - reporting must not raise either
            log.exception("reporting a %s error failed", where)


class DuplicateHandler(ChaosError):
    """Two flows registered a handler for the same message type (a bug in the daemon)."""


def merge_handlers(*tables: dict[type, Handler]) -> dict[type, Handler]:
    """The flows' handler tables as one; each message type has exactly one handler.

    Raises:
        DuplicateHandler: a message type is in more than one table.
    """
    merged: dict[type, Handler] = {}
    for table in tables:
        for kind, handler in table.items():
            if kind in merged:
                raise DuplicateHandler(f"two handlers for {kind.__name__}")
            merged[kind] = handler
    return merged


def scheduler_side(
    facts: DaemonFacts, fn: Callable[[SchedulerRole, Any, ReplyPath | None, float], None]
) -> Handler:
    """A handler run only while this node holds the scheduler role (a member drops the
    message): ``fn(role, message, reply, now)``."""

    def handler(msg: Any, reply: ReplyPath | None, now: float) -> None:
        role = facts.role
        if role is not None:
            fn(role, msg, reply, now)

    return handler
