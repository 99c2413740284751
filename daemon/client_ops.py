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
from chaos.daemon.client import DaemonClient
from chaos.daemon.dispatch import Handler, fault_permission
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.relayed import RelayedOps
from chaos.daemon.replies import policy_reply, status_reply
from chaos.daemon.scheduler.role import DaemonContext, DaemonFacts
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
from chaos.protocol.ids import is_loopback_endpoint
from chaos.protocol.messages import DoctorCheck, DoctorReply, DoctorRequest


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
            DoctorRequest: self.on_doctor,
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

    def on_doctor(self, msg: DoctorRequest, reply: ReplyPath | None, now: float) -> None:
        """Answers ``doctor``: this daemon's checks of its own setup, worst first."""
        checks = self._doctor_checks(now)
        order = {"fail": 0, "warn": 1, "ok": 2}
        checks.sort(key=lambda c: order[c.status])
        f = self.ctx.facts
        self.ctx.out.respond(reply, DoctorReply(sender=f.node_id, epoch=f.epoch, checks=checks))

    def _doctor_checks(self, now: float) -> list[DoctorCheck]:
        f = self.ctx.facts
        checks = [_membership_check(f.state, len(f.members())), _address_check(f)]
        if f.active:
            checks.append(_scheduler_check(f, now))
        down = sorted(p.peer for p in self.agent.links.values() if not p.up)
        if down:
            checks.append(DoctorCheck(name="links", status="warn", detail=f"links down: {down}",
                                      fix="check the network between this device and them"))
        else:
            checks.append(DoctorCheck(name="links", status="ok",
                                      detail=f"{len(self.agent.links)} overlay links up"))
        if self.trainer.registration is None:
            checks.append(DoctorCheck(name="trainer", status="warn", detail="no trainer "
                                      "registered here", fix="start the training script with "
                                      "this daemon's endpoint (Trainer(daemon=...))"))
        else:
            phase = self.trainer.phase.value if self.trainer.phase is not None else "registered"
            checks.append(DoctorCheck(name="trainer", status="ok", detail=f"trainer {phase}"))
        return checks  # fmt: skip


def _scheduler_check(f: DaemonFacts, now: float) -> DoctorCheck:
    """Whether an active member follows a scheduler (or is it)."""
    e = f.election
    if f.is_scheduler:
        return DoctorCheck(name="scheduler", status="ok",
                           detail=f"this node is the scheduler (term {f.term})")  # fmt: skip
    if f.paused or e.scheduler is None:
        return DoctorCheck(name="scheduler", status="fail",
                           detail="paused: no scheduler with a majority",
                           fix="a majority of the members must reach one another: check the "
                           "links (chaos-daemon status) and that the other devices run",
                           )  # fmt: skip
    heard = now - e.last_scheduler_contact
    return DoctorCheck(name="scheduler", status="ok",
                       detail=f"following {e.scheduler}, heard {heard:.1f} s ago")  # fmt: skip


def _membership_check(state: DaemonState, members: int) -> DoctorCheck:
    """Whether this daemon is an active member."""
    if state == DaemonState.ACTIVE:
        return DoctorCheck(name="membership", status="ok",
                           detail=f"an active member of {members}")  # fmt: skip
    if state == DaemonState.JOINING:
        return DoctorCheck(name="membership", status="warn", detail="joining",
                           fix="if it stays so, check that a member's address in --join is "
                           "reachable from this device")  # fmt: skip
    return DoctorCheck(name="membership", status="fail", detail=state.value,
                       fix="start the daemon again (chaos-daemon start)")  # fmt: skip


def _address_check(f: DaemonFacts) -> DoctorCheck:
    """Whether the members can reach the address this daemon advertises: a loopback or
    wildcard address reaches nobody when another member is on a network."""
    mine = f.address
    host = mine.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    others = [n.address for n in (f.view.nodes if f.view else []) if n.id != f.node_id]
    networked = [a for a in others if not is_loopback_endpoint(a)]
    if host in ("0.0.0.0", "::", "*"):
        return DoctorCheck(name="address", status="fail",
                           detail=f"advertises the wildcard {mine}: nobody can dial it",
                           fix="start with --listen tcp://ADDRESS:PORT, this device's address "
                           "on the cluster's network")  # fmt: skip
    if is_loopback_endpoint(mine) and networked:
        return DoctorCheck(name="address", status="fail",
                           detail=f"advertises loopback {mine} while a member is at "
                           f"{networked[0]}: the others cannot reach this device",
                           fix="start with --listen tcp://ADDRESS:PORT, this device's address "
                           "on the cluster's network")  # fmt: skip
    return DoctorCheck(name="address", status="ok", detail=f"advertises {mine}")


def call_doctor(client: DaemonClient, timeout_s: float | None = None) -> DoctorReply:
    """Asks a daemon for its ``doctor`` checks (the request :meth:`ClientRequests.on_doctor`
    answers).

    Raises:
        ChaosTimeout: no answer in time.
        RequestRefused: the daemon does not know the request (an older daemon: ``malformed``).
    """
    return client.ask(DoctorRequest(), DoctorReply, timeout_s)
