"""The local clients' requests: answered here, or relayed to the scheduler and answered later.

:class:`ClientRequests` answers ``status``, ``policy`` and ``fault`` at once (``fault`` only with
``enable_fault_injection``; who may send which command is decided before, in
:func:`chaos.daemon.dispatch.client_permission`); it turns a
``link add``/``link remove`` into a :class:`~chaos.protocol.LinkRequest` to the scheduler (and,
for a connect, measures the new link while the request travels), which
:class:`~chaos.daemon.relayed.RelayedOps` holds until the scheduler answers.
"""

from __future__ import annotations

import uuid

from chaos.daemon.agent import Agent
from chaos.daemon.dispatch import Handler, fault_permission
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.relayed import RelayedOps
from chaos.daemon.replies import policy_reply, status_reply
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.states import DaemonState
from chaos.daemon.transport import FaultInjector, ReplyPath, Transport

from chaos.protocol import (
    ConnectCommand,
    FaultCommand,
    FaultReply,
    LinkCommand,
    LinkRequest,
    PolicyRequest,
    Reason,
    Refusal,
    StatusRequest,
)


class ClientRequests:
    """Answers and relays the local clients' requests.

    Args:
        ctx: The daemon's context.
        relayed: The requests relayed to the scheduler (a link command goes there).
        faults: The injected faults (the ``fault`` command sets them).
        agent: Measures a link asked for while its request travels; its latest measurements
            show in ``status``.
        trainer: The local trainer's relay (its audit, phase and notes show in ``status``).
        transport: Where the policy notices are published (the policy names it).
    """

    def __init__(
        self,
        ctx: DaemonContext,
        relayed: RelayedOps,
        faults: FaultInjector,
        agent: Agent,
        trainer: TrainerRelay,
        transport: Transport,
    ) -> None:
        self.ctx = ctx
        self.relayed = relayed
        self.faults = faults
        self.agent = agent
        self.trainer = trainer
        self.transport = transport

    def handlers(self) -> dict[type, Handler]:
        """The local clients' flow: status, the trainer's policy, fault injection and link
        commands."""
        return {
            StatusRequest: self.on_status,
            PolicyRequest: self.on_policy_request,
            FaultCommand: self.on_fault,
            LinkCommand: self.on_link_command,
        }

    def on_status(self, msg: StatusRequest, reply: ReplyPath | None, now: float) -> None:
        """Answers ``status``."""
        self.ctx.out.respond(reply, status_reply(self.ctx, self.agent.measured, self.trainer))

    def on_policy_request(self, msg: PolicyRequest, reply: ReplyPath | None, now: float) -> None:
        """Answers the trainer's policy request."""
        self.ctx.out.respond(reply, policy_reply(self.ctx.facts, self.transport.notify_endpoint))

    def on_fault(self, msg: FaultCommand, reply: ReplyPath | None, now: float) -> None:
        """Sets an injected fault and answers with the faults now active; refused
        (``forbidden``) unless the daemon runs with ``enable_fault_injection``."""
        h = self.ctx
        why = fault_permission(h.cfg)
        if why is not None:
            h.event("refused_command", type="fault_command", detail=why)
            no = Refusal(
                sender=h.node_id,
                epoch=h.facts.epoch,
                reason=Reason.FORBIDDEN,
                detail=why,
                ref_type="fault_command",
                term=h.facts.term,
            )
            h.out.respond(reply, no)
            return
        self.faults.apply(msg.name, list(msg.peers))
        h.event("fault", fault=msg.name, peers=list(msg.peers))
        active = self.faults.describe()
        h.out.respond(reply, FaultReply(sender=h.node_id, epoch=h.facts.epoch, active=active))

    def on_link_command(self, msg: LinkCommand, reply: ReplyPath | None, now: float) -> None:
        """``link add``/``link remove``: relayed to the scheduler as a :class:`LinkRequest`."""
        h = self.ctx
        op_id = uuid.uuid4().hex[:12]
        if msg.peer == h.node_id or h.facts.state != DaemonState.ACTIVE:
            why = "itself" if msg.peer == h.node_id else f"while {h.facts.state.value}"
            self.ctx.result(reply, op_id, Reason.BAD_REQUEST, f"cannot link {why}")
            return
        # connect-link: measure the new link while the request travels to the scheduler
        # (saves the scheduler's order to measure it, a round trip on the critical path)
        address = self.ctx.facts.view_address(msg.peer) if msg.op == "connect" else None
        req = LinkRequest(
            sender=h.node_id,
            epoch=h.facts.epoch,
            a=h.node_id,
            b=msg.peer,
            op=msg.op,
            op_id=op_id,
            premeasured=address is not None,
        )
        self.relayed.relay(reply, req, op_id)
        if address is not None and self.relayed.waiting(op_id):
            self.agent.on_connect(
                ConnectCommand(
                    sender=h.node_id,
                    epoch=h.facts.epoch,
                    term=h.facts.term,
                    peer=msg.peer,
                    address=address,
                    measure_bandwidth=False,
                    op_id="pre-" + op_id,
                ),
                now,
            )
