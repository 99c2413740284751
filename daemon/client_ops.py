"""The local clients' requests: answered here, or relayed to the scheduler and answered later.

:class:`ClientRequests` answers ``status``, ``policy`` and ``fault`` at once (``fault`` only with
``enable_fault_injection``; who may send which command is decided before, in
:func:`chaos.daemon.dispatch.client_permission`); it turns a
``link add``/``link remove`` into a :class:`~chaos.protocol.LinkRequest` to the scheduler (and,
for a connect, measures the new link while the request travels); and it keeps every request
relayed to the scheduler (the trainer's too) until the scheduler's
:class:`~chaos.protocol.OpResult` comes back, or answers it with a failure after
``op_timeout_s``. When another scheduler takes over, every request still waiting is sent again to
it (the old one may have died with it), and its ``op_timeout_s`` starts anew.

The local trainer's messages are patient: one that comes while no scheduler is known (e.g. during
an election) is held, not refused, and sent as soon as a scheduler is known. A trainer's
registration (its join) waits for the scheduler's answer up to the daemon's ``join_timeout_s``
(at least ``op_timeout_s``), however many schedulers come and go meanwhile.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import msgspec
from chaos.daemon.agent import Agent
from chaos.daemon.dispatch import fault_permission
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.replies import ReplySource, policy_reply, status_reply
from chaos.daemon.states import DaemonState
from chaos.daemon.transport import FaultInjector, ReplyPath

from chaos.protocol import (
    ConnectCommand,
    FaultCommand,
    FaultReply,
    LinkCommand,
    LinkRequest,
    Message,
    OpResult,
    PolicyRequest,
    Reason,
    Refusal,
    StatusRequest,
    StepFailed,
    TrainerEventBase,
    TrainerInfo,
)


class ClientHost(ReplySource, Protocol):
    """What the client requests need from the daemon."""

    def respond(self, reply: ReplyPath | None, msg: Message) -> None: ...  # noqa: D102

    def to_scheduler(self, msg: Message) -> bool: ...  # noqa: D102

    def event(self, name: str, **fields: object) -> None: ...  # noqa: D102


@dataclass
class _ClientOp:
    reply: ReplyPath | None
    deadline: float
    msg: Message
    sent: bool = True  # False: held until a scheduler is known


class ClientRequests:
    """Answers and relays the local clients' requests.

    Args:
        host: The daemon.
        faults: The injected faults (the ``fault`` command sets them).
        agent: Measures a link asked for while its request travels.
        trainer: The local trainer's relay (a relayed message that fails is forgotten there).
    """

    def __init__(
        self, host: ClientHost, faults: FaultInjector, agent: Agent, trainer: TrainerRelay
    ) -> None:
        self.host = host
        self.faults = faults
        self.agent = agent
        self.trainer = trainer
        self._waiting: dict[str, _ClientOp] = {}
        self._scheduler: tuple[str | None, int] = (None, 0)  # the one last sent to, its term

    # -- answers ---------------------------------------------------------------------------

    def result(
        self,
        reply: ReplyPath | None,
        op_id: str,
        reason: Reason | None = None,
        detail: str = "",
    ) -> None:
        """Answers a client with an :class:`OpResult` (failed when ``reason`` is given)."""
        h = self.host
        ok = reason is None
        msg = OpResult(
            sender=h.node_id, epoch=h.epoch, op_id=op_id, ok=ok, reason=reason, detail=detail
        )
        h.respond(reply, msg)

    def on_status(self, msg: StatusRequest, reply: ReplyPath | None, now: float) -> None:
        """Answers ``status``."""
        self.host.respond(reply, status_reply(self.host))

    def on_policy_request(self, msg: PolicyRequest, reply: ReplyPath | None, now: float) -> None:
        """Answers the trainer's policy request."""
        self.host.respond(reply, policy_reply(self.host))

    def on_fault(self, msg: FaultCommand, reply: ReplyPath | None, now: float) -> None:
        """Sets an injected fault and answers with the faults now active; refused
        (``forbidden``) unless the daemon runs with ``enable_fault_injection``."""
        h = self.host
        why = fault_permission(h.cfg)
        if why is not None:
            h.event("refused_command", type="fault_command", detail=why)
            no = Refusal(
                sender=h.node_id,
                epoch=h.epoch,
                reason=Reason.FORBIDDEN,
                detail=why,
                ref_type="fault_command",
                term=h.term,
            )
            h.respond(reply, no)
            return
        self.faults.apply(msg.name, list(msg.peers))
        h.event("fault", fault=msg.name, peers=list(msg.peers))
        h.respond(reply, FaultReply(sender=h.node_id, epoch=h.epoch, active=self.faults.describe()))

    # -- relayed to the scheduler ----------------------------------------------------------

    def relay(self, reply: ReplyPath | None, msg: Message, op_id: str) -> None:
        """Sends a client's request to the scheduler; its :class:`OpResult` goes back to the
        client (a failure if none comes within ``op_timeout_s``; ``join_timeout_s`` for a
        trainer's registration). A trainer's message that comes while no scheduler is known is
        held until one is; any other request is then refused (``paused``)."""
        cfg = self.host.cfg
        now = time.monotonic()
        wait_s = max(cfg.op_timeout_s, cfg.join_timeout_s) if _is_join(msg) else cfg.op_timeout_s
        op = _ClientOp(reply, now + wait_s, msg)
        self._waiting[op_id] = op
        scheduler = self.host.election.scheduler
        if self.host.to_scheduler(msg):
            self.host.event("relayed", op_id=op_id, type=type(msg).__name__, scheduler=scheduler)
        elif _is_patient(msg):
            op.sent = False
            self.host.event("relay_held", op_id=op_id, type=type(msg).__name__)
        else:
            del self._waiting[op_id]
            self.trainer.forget(op_id)
            self.result(reply, op_id, Reason.PAUSED, "no scheduler")

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
                msg = msgspec.structs.replace(msg, epoch=self.host.epoch)  # not the failed one
            if self.host.to_scheduler(msg):
                op.deadline = max(op.deadline, now + self.host.cfg.op_timeout_s)
                name = "relay_resent" if op.sent else "relayed"
                op.sent = True
                self.host.event(name, op_id=op_id, type=type(msg).__name__, scheduler=scheduler)

    def on_result(self, msg: OpResult) -> None:
        """Passes the scheduler's answer on to the client waiting for it."""
        op = self._waiting.pop(msg.op_id, None)
        if op is not None:
            self.host.respond(op.reply, msgspec.structs.replace(msg, sender=self.host.node_id))

    def refused(self, op_id: str, reason: Reason, detail: str) -> None:
        """Answers the client whose relayed request the scheduler refused."""
        op = self._waiting.pop(op_id, None)
        if op is not None:
            self.result(op.reply, op_id, reason, detail)

    def expire(self, now: float) -> None:
        """Answers the requests the scheduler left unanswered past their deadline."""
        for op_id, op in list(self._waiting.items()):
            if now > op.deadline:
                del self._waiting[op_id]
                self.trainer.forget(op_id)
                self.result(op.reply, op_id, Reason.TIMEOUT, "no answer from the scheduler")

    def on_link_command(self, msg: LinkCommand, reply: ReplyPath | None, now: float) -> None:
        """``link add``/``link remove``: relayed to the scheduler as a :class:`LinkRequest`."""
        h = self.host
        op_id = uuid.uuid4().hex[:12]
        if msg.peer == h.node_id or h.state != DaemonState.ACTIVE:
            why = "itself" if msg.peer == h.node_id else f"while {h.state.value}"
            self.result(reply, op_id, Reason.BAD_REQUEST, f"cannot link {why}")
            return
        # connect-link: measure the new link while the request travels to the scheduler
        # (saves the scheduler's order to measure it, a round trip on the critical path)
        address = self._view_address(msg.peer) if msg.op == "connect" else None
        req = LinkRequest(
            sender=h.node_id,
            epoch=h.epoch,
            a=h.node_id,
            b=msg.peer,
            op=msg.op,
            op_id=op_id,
            premeasured=address is not None,
        )
        self.relay(reply, req, op_id)
        if address is not None and op_id in self._waiting:
            self.agent.on_connect(
                ConnectCommand(
                    sender=h.node_id,
                    epoch=h.epoch,
                    term=h.term,
                    peer=msg.peer,
                    address=address,
                    measure_bandwidth=False,
                    op_id="pre-" + op_id,
                ),
                now,
            )

    def _view_address(self, peer: str) -> str | None:
        """The control address of ``peer`` in the installed view (``None``: not a member)."""
        view = self.host.view
        if view is None:
            return None
        return next((n.address for n in view.nodes if n.id == peer), None)


def _is_patient(msg: Message) -> bool:
    """The local trainer's messages wait for a scheduler instead of being refused."""
    return isinstance(msg, (TrainerInfo, TrainerEventBase))


def _is_join(msg: Message) -> bool:
    """A trainer's registration: it waits up to ``join_timeout_s`` for the scheduler."""
    return isinstance(msg, TrainerInfo)
