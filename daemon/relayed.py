"""The requests a daemon relays to the scheduler, held until the scheduler answers.

:class:`RelayedOps` keeps every request relayed to the scheduler (a local client's, the local
trainer's) until the scheduler's :class:`~chaos.protocol.OpResult` comes back, or answers it with
a failure after ``op_timeout_s``. When another scheduler takes over, every request still waiting
is sent again to it (the old one may have died with it), and its ``op_timeout_s`` starts anew.

The local trainer's messages are patient: one that comes while no scheduler is known (e.g. during
an election) is held, not refused, and sent as soon as a scheduler is known. A trainer's
registration (its join) waits for the scheduler's answer up to the daemon's ``join_timeout_s``
(at least ``op_timeout_s``), however many schedulers come and go meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    Message,
    OpResult,
    Reason,
    StepFailed,
    TrainerEventBase,
    TrainerInfo,
)


@dataclass
class _ClientOp:
    reply: ReplyPath | None
    deadline: float
    msg: Message
    sent: bool = True  # False: held until a scheduler is known


class RelayedOps:
    """The requests relayed to the scheduler, each until its answer or its deadline.

    Args:
        ctx: The daemon's context.
    """

    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self._waiting: dict[str, _ClientOp] = {}
        self._scheduler: tuple[str | None, int] = (None, 0)  # the one last sent to, its term
        self.on_dropped: list[Callable[[str], None]] = []
        """Told the op id of a request that failed without the scheduler's answer."""

    def waiting(self, op_id: str) -> bool:
        """Whether the request ``op_id`` still waits for the scheduler's answer."""
        return op_id in self._waiting

    def _dropped(self, op_id: str) -> None:
        for hook in self.on_dropped:
            hook(op_id)

    def relay(self, reply: ReplyPath | None, msg: Message, op_id: str) -> None:
        """Sends a client's request to the scheduler; its :class:`OpResult` goes back to the
        client (a failure if none comes within ``op_timeout_s``; ``join_timeout_s`` for a
        trainer's registration). A trainer's message that comes while no scheduler is known is
        held until one is; any other request is then refused (``paused``)."""
        cfg = self.ctx.cfg
        now = time.monotonic()
        wait_s = max(cfg.op_timeout_s, cfg.join_timeout_s) if _is_join(msg) else cfg.op_timeout_s
        op = _ClientOp(reply, now + wait_s, msg)
        self._waiting[op_id] = op
        scheduler = self.ctx.facts.election.scheduler
        if self.ctx.out.to_scheduler(msg):
            self.ctx.event("relayed", op_id=op_id, type=type(msg).__name__, scheduler=scheduler)
        elif _is_patient(msg):
            op.sent = False
            self.ctx.event("relay_held", op_id=op_id, type=type(msg).__name__)
        else:
            del self._waiting[op_id]
            self._dropped(op_id)
            self.ctx.result(reply, op_id, Reason.PAUSED, "no scheduler")

    def follow_scheduler(self, scheduler: str | None, term: int, now: float) -> None:
        """Sends the requests still waiting again when another scheduler (or a new term) takes
        over, or when a scheduler is known again after none was: the old scheduler may have
        died before it answered, or have lost this member (cut off, failed, joined again), and
        nothing else would tell it. Each gets at least ``op_timeout_s`` anew (a registration
        keeps its longer deadline). A held request goes to the first scheduler known. A
        scheduler that took a request twice answers it twice (a repeated registration or event
        changes nothing more); the client takes the first answer.

        Args:
            scheduler: The scheduler this daemon now knows (``None``: none, e.g. an election).
            term: Its term.
            now: ``time.monotonic()``.
        """
        if scheduler is None:
            # a scheduler known again after this (the same one, after this daemon was cut off
            # and joined again) gets the waiting requests again: it may have dropped them
            # with this member, and nothing else would tell it
            self._scheduler = (None, 0)
            return
        changed = (scheduler, term) != self._scheduler
        self._scheduler = (scheduler, term)
        for op_id, op in list(self._waiting.items()):
            if op.sent and not changed:
                continue
            msg = op.msg
            if not isinstance(msg, StepFailed):
                msg = msgspec.structs.replace(msg, epoch=self.ctx.facts.epoch)  # not the failed one
            if self.ctx.out.to_scheduler(msg):
                op.deadline = max(op.deadline, now + self.ctx.cfg.op_timeout_s)
                name = "relay_resent" if op.sent else "relayed"
                op.sent = True
                self.ctx.event(name, op_id=op_id, type=type(msg).__name__, scheduler=scheduler)

    def on_result(self, msg: OpResult) -> None:
        """Passes the scheduler's answer on to the client waiting for it."""
        op = self._waiting.pop(msg.op_id, None)
        if op is not None:
            self.ctx.out.respond(op.reply, msgspec.structs.replace(msg, sender=self.ctx.node_id))

    def refused(self, op_id: str, reason: Reason, detail: str) -> None:
        """Answers the client whose relayed request the scheduler refused."""
        op = self._waiting.pop(op_id, None)
        if op is not None:
            self.ctx.result(op.reply, op_id, reason, detail)

    def expire(self, now: float) -> None:
        """Answers the requests the scheduler left unanswered past their deadline."""
        for op_id, op in list(self._waiting.items()):
            if now > op.deadline:
                del self._waiting[op_id]
                self._dropped(op_id)
                self.ctx.result(op.reply, op_id, Reason.TIMEOUT, "no answer from the scheduler")


def _is_patient(msg: Message) -> bool:
    """The local trainer's messages wait for a scheduler instead of being refused."""
    return isinstance(msg, (TrainerInfo, TrainerEventBase))


def _is_join(msg: Message) -> bool:
    """A trainer's registration: it waits up to ``join_timeout_s`` for the scheduler."""
    return isinstance(msg, TrainerInfo)
