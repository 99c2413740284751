"""The daemon: one single-threaded event loop over ZeroMQ sockets and a few timers.

The loop polls the sockets with a timeout equal to the time to the next timer (heartbeat, link
probe, election timeout, failure check, housekeeping), so an idle daemon sleeps in ``zmq_poll``.
Every inbound frame goes through :func:`chaos.protocol.validate` and then to one handler chosen by
message type. Messages a node sends to itself (the scheduler is also a member) go through a local
queue, never through recursion.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from chaos.daemon.agent import Agent
from chaos.daemon.config import DaemonConfig, parse_fault_spec
from chaos.daemon.election import Election
from chaos.daemon.events import EventLog
from chaos.daemon.membership import Membership
from chaos.daemon.metrics import Metrics
from chaos.daemon.replies import policy_notice, policy_reply, status_reply
from chaos.daemon.scheduler.negotiator import Negotiator
from chaos.daemon.scheduler.trainers import TrainerRelay
from chaos.daemon.states import DAEMON_TRANSITIONS, DaemonState, Role
from chaos.daemon.transport import FaultInjector, Inbound, ReplyPath, Transport

from chaos.errors import ChaosError
from chaos.protocol import (
    AgentReport,
    BulkAck,
    BulkData,
    ClusterUpdate,
    ClusterView,
    ConnectCommand,
    FaultCommand,
    FaultReply,
    JoinRequest,
    LeaderHeartbeat,
    LeaveCommand,
    LeaveRequest,
    LinkCommand,
    LinkReport,
    LinkRequest,
    MemberHeartbeat,
    Message,
    OpResult,
    Ping,
    PolicyAck,
    PolicyRequest,
    Pong,
    Reason,
    Refusal,
    Rejected,
    RequestVote,
    StatusRequest,
    TimeoutNow,
    TrainerEvent,
    TrainerInfo,
    TrainerRegister,
    ValidationContext,
    VoteReply,
    encode,
    refusal,
    tag_of,
    validate,
)

log = logging.getLogger("chaos.daemon")

_HOUSEKEEPING_S = 0.1
_MEASURE_TICK_S = 0.005
_MAX_POLL_S = 1.0

Handler = Callable[[Any, ReplyPath | None, float], None]


@dataclass
class _ClientOp:
    reply: ReplyPath | None
    deadline: float


class Daemon:
    """One ``chaos-daemon``.

    Args:
        cfg: The validated configuration.
        rng: Randomness for election timeouts (seed it in tests).

    Raises:
        ConfigError: an endpoint cannot be bound.
        OSError: the event log cannot be opened.
    """

    def __init__(self, cfg: DaemonConfig, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.address = cfg.listen
        self.faults = FaultInjector()
        for spec in cfg.faults:
            name, peers = parse_fault_spec(spec)
            self.faults.apply(name, peers)
        self.events = EventLog(cfg.resolved_event_log, cfg.node_id)
        self.metrics = Metrics(cfg.node_id, cfg.metrics_port)
        self.transport = Transport(
            cfg.listen, cfg.resolved_ipc_endpoint, cfg.max_frame_bytes, self.faults
        )
        self.election = Election(cfg.node_id, cfg, rng)
        self.agent = Agent(self, cfg)
        self.trainer = TrainerRelay(self)
        self.membership = Membership(self)
        self.negotiator: Negotiator | None = None
        self.state = DaemonState.STARTING
        self.view: ClusterView | None = None
        self.update: ClusterUpdate | None = None
        self._ctx: tuple[tuple[object, ...], ValidationContext] | None = None
        self._local: deque[Message] = deque()
        self._clients: dict[str, _ClientOp] = {}
        self._prev_leader: tuple[str, float] | None = None
        self._stop = False
        self._leave_requested = False
        self.exit_code = 0
        self.refused = 0
        self._due: dict[str, float] = {}
        self._notice: tuple[int, bool] | None = None  # the last (epoch, paused) published
        self._handlers: dict[type, Handler] = self._handler_table()

    # -- small API used by the agent and the negotiator -------------------------------------

    @property
    def epoch(self) -> int:
        """The installed view's epoch (0 before any)."""
        return self.view.epoch if self.view is not None else 0

    @property
    def term(self) -> int:
        """The current election term."""
        return self.election.term

    @property
    def is_scheduler(self) -> bool:
        """Whether this node is the scheduler."""
        return self.election.role == Role.SCHEDULER and self.negotiator is not None

    def members(self) -> list[str]:
        """Current membership (the scheduler's monitor, else the installed view)."""
        if self.negotiator is not None:
            return self.negotiator.monitor.members()
        return [n.id for n in self.view.nodes] if self.view is not None else []

    def send(self, peer: str, msg: Message, attachment: bytes | None = None) -> bool:
        """Sends to a peer (to itself through the local queue), with ``attachment`` if given."""
        if peer == self.node_id:
            self._local.append(msg)
            return True
        return self.transport.send_peer(peer, encode(msg), attachment)

    def broadcast(self, peers: dict[str, str], msg: Message) -> None:
        """Sends one message to several peers (id -> address), encoding it once."""
        frame = encode(msg)
        for peer, address in peers.items():
            if peer == self.node_id:
                self._local.append(msg)
            else:
                self.transport.ensure_peer(peer, address)
                self.transport.send_peer(peer, frame)

    def to_scheduler(self, msg: Message) -> bool:
        """Sends to the scheduler; ``False`` when none is known."""
        leader = self.node_id if self.is_scheduler else self.election.leader
        return leader is not None and self.send(leader, msg)

    def respond(self, reply: ReplyPath | None, msg: Message) -> None:
        """Answers on an inbound frame's path (``None``: a local message)."""
        if reply is None:
            self._local.append(msg)
        else:
            self.transport.reply(reply, encode(msg))

    def result(
        self,
        reply: ReplyPath | None,
        op_id: str,
        reason: Reason | None = None,
        detail: str = "",
    ) -> None:
        """Answers a client with an :class:`OpResult` (failed when ``reason`` is given)."""
        ok = reason is None
        msg = OpResult(
            sender=self.node_id, epoch=self.epoch, op_id=op_id, ok=ok, reason=reason, detail=detail
        )
        self.respond(reply, msg)

    def relay(self, reply: ReplyPath | None, msg: Message, op_id: str) -> None:
        """Sends a client's request to the scheduler; its :class:`OpResult` goes back to the
        client (a failure if none comes within ``op_timeout_s``)."""
        self._clients[op_id] = _ClientOp(reply, time.monotonic() + self.cfg.op_timeout_s)
        if not self.to_scheduler(msg):
            del self._clients[op_id]
            self.trainer.forget(op_id)
            self.result(reply, op_id, Reason.PAUSED, "no scheduler")

    def send_to_address(self, peer: str, address: str, msg: Message) -> None:
        """Opens a DEALER to ``peer`` if needed and sends."""
        self.transport.ensure_peer(peer, address)
        self.send(peer, msg)

    def connect_peer(self, peer: str, address: str) -> bool:
        """Opens the DEALER to ``peer``; ``True`` when it was already open."""
        return peer != self.node_id and self.transport.ensure_peer(peer, address)

    def event(self, name: str, **fields: object) -> None:
        """Logs an event to the JSONL log and the ``logging`` module."""
        self.events.emit(name, **fields)
        log.info("%s %s %s", self.node_id, name, fields if fields else "")

    def observe_primitive(self, name: str, seconds: float) -> None:
        """Records a primitive's control-path time."""
        self.metrics.primitive(name, seconds)

    @property
    def active(self) -> bool:
        """Whether this daemon is an active member."""
        return self.state == DaemonState.ACTIVE

    def lost_quorum(self) -> None:
        """The scheduler no longer hears a majority: step down and pause."""
        self.negotiator = None
        self.election.step_down(self.election.term, time.monotonic())
        self.event("paused", reason="no majority heard", term=self.term)

    def request_leave(self) -> None:
        """Asks the loop to leave gracefully (safe from a signal handler)."""
        self._leave_requested = True

    def set_state(self, state: DaemonState) -> None:
        """Moves the lifecycle to ``state``.

        Raises:
            ChaosError: ``DAEMON_TRANSITIONS`` does not allow the move.
        """
        if state != self.state and state not in DAEMON_TRANSITIONS[self.state]:
            raise ChaosError(f"daemon state {self.state.value} -> {state.value} not allowed")
        self.state = state

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs until the node left or failed to join.

        Returns:
            The exit code: 0 after a leave, 3 if the join was refused, 4 if it timed out.
        """
        now = time.monotonic()
        self.event(
            "started", address=self.address, ipc=self.transport.ipc_endpoint, join=self.cfg.join
        )
        if self.cfg.join is None:
            self.set_state(DaemonState.ACTIVE)
            self._become_scheduler(now, bootstrap=True)
        else:
            self.membership.begin_join(now, self.cfg.join, list(self.cfg.neighbors))
        try:
            while not self._stop:
                self._step()
        finally:
            self.event("stopped", exit_code=self.exit_code)
            self.transport.close(linger_s=0.2)
            self.events.close()
        return self.exit_code

    def _step(self) -> None:
        now = time.monotonic()
        if self._leave_requested:
            self._leave_requested = False
            self.membership.start_leave(None, now)
        self._run_timers(now)
        timeout = 0.0 if self._local else max(0.0, min(self._due.values()) - time.monotonic())
        for inbound in self.transport.poll(min(timeout, _MAX_POLL_S)):
            if self._stop:  # left: commit nothing more that it could not see through
                break
            self._on_frame(inbound)
        while self._local and not self._stop:
            self._dispatch(self._local.popleft(), None, time.monotonic())
        notice = (self.epoch, self._paused)  # trainers hear of a change without asking
        if notice != self._notice or now >= self._due.get("notice", 0.0):
            changed, self._notice = notice != self._notice, notice
            self._due["notice"] = now + self.cfg.heartbeat_interval_s
            self.transport.publish(encode(policy_notice(self, with_policy=changed)))

    def _run_timers(self, now: float) -> None:
        due = self._due
        if now >= due.get("heartbeat", 0.0):
            due["heartbeat"] = now + self.cfg.heartbeat_interval_s
            self._heartbeat(now)
        if now >= due.get("probe", 0.0):
            due["probe"] = now + self.cfg.link_probe_interval_s
            if self.state == DaemonState.ACTIVE:
                self.agent.probe_links(now)
        if now >= due.get("resources", 0.0):
            due["resources"] = now + self.cfg.resource_interval_s
            self.agent.sample_resources()
        if now >= due.get("housekeeping", 0.0):
            due["housekeeping"] = now + _HOUSEKEEPING_S
            self._housekeeping(now)
        if self.agent.busy:
            self.agent.tick_measurements(now)
        due["measure"] = now + _MEASURE_TICK_S if self.agent.busy else now + _MAX_POLL_S
        if self.state == DaemonState.ACTIVE and not self.is_scheduler:
            if now >= self.election.deadline:
                self._start_election(now)
            due["election"] = self.election.deadline
        else:
            due["election"] = now + _MAX_POLL_S
        if self.negotiator is not None:
            nxt = min(self.negotiator.next_failure_deadline(), self.negotiator.rebuild_deadline)
            if now >= nxt or now >= due.get("failures", 0.0):
                self.negotiator.check_failures(now)
            if self.negotiator is not None:
                due["failures"] = max(
                    now + 0.001,
                    min(
                        self.negotiator.next_failure_deadline(), now + self.cfg.heartbeat_interval_s
                    ),
                )
        else:
            due["failures"] = now + _MAX_POLL_S

    def _heartbeat(self, now: float) -> None:
        if self.is_scheduler and self.negotiator is not None:
            self.election.last_leader_contact = now
            self.negotiator.on_heartbeat(self.node_id, self.agent.resources, now)
            hb = LeaderHeartbeat(sender=self.node_id, epoch=self.epoch, term=self.term)
            frame = encode(hb)
            for m in self.members():
                if m != self.node_id:
                    self.transport.send_peer(m, frame)
        elif self.state == DaemonState.ACTIVE and self.election.leader is not None:
            self.to_scheduler(
                MemberHeartbeat(
                    sender=self.node_id,
                    epoch=self.epoch,
                    term=self.term,
                    resources=self.agent.resources,
                )
            )
        self.metrics.state(
            self.epoch, self.term, len(self.members()), self.is_scheduler, self._paused
        )

    def _housekeeping(self, now: float) -> None:
        if self.negotiator is not None:
            self.negotiator.tick(now)
        for op_id, op in list(self._clients.items()):
            if now > op.deadline:
                del self._clients[op_id]
                self.trainer.forget(op_id)
                self.result(op.reply, op_id, Reason.TIMEOUT, "no answer from the scheduler")
        self.membership.tick(now)

    @property
    def paused(self) -> bool:
        """Whether this member pauses (no scheduler with a majority)."""
        return self._paused

    @property
    def _paused(self) -> bool:
        return self.state == DaemonState.ACTIVE and self.election.paused

    # -- frames ----------------------------------------------------------------------------

    def _context(self) -> ValidationContext:
        """The validation context, rebuilt only when something it holds may have changed."""
        neg = self.negotiator
        key = (
            self.epoch,
            self.term,
            self.election.role,
            self.state,
            self._paused,
            neg,
            neg.monitor.version if neg is not None else -1,
            self.view,  # compared by identity first: a new view is a new object
        )
        if self._ctx is not None and self._ctx[0] == key:
            return self._ctx[1]
        ctx = self._build_context()
        self._ctx = (key, ctx)
        return ctx

    def _build_context(self) -> ValidationContext:
        return ValidationContext(
            max_frame_bytes=self.cfg.max_frame_bytes,
            epoch=self.epoch,
            term=self.term,
            members=frozenset(self.members()),
            is_scheduler=self.is_scheduler,
            paused=self._paused,
            joining=self.state == DaemonState.JOINING,
            node_id=self.node_id,
        )

    def _on_frame(self, inbound: Inbound) -> None:
        now = time.monotonic()
        ctx = self._context()
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
        self.metrics.message(tag_of(result))
        self._dispatch(result, inbound.reply, now)

    def _dispatch(self, msg: Message, reply: ReplyPath | None, now: float) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            return
        try:
            handler(msg, reply, now)
        except Exception as exc:  # a bug must not take the control plane down
            log.exception("handler for %s failed", tag_of(msg))
            self.events.emit("handler_error", type=tag_of(msg), error=repr(exc)[:300])

    def _handler_table(self) -> dict[type, Handler]:
        return {
            LeaderHeartbeat: self._on_leader_heartbeat,
            MemberHeartbeat: self._on_member_heartbeat,
            RequestVote: self._on_request_vote,
            VoteReply: self._on_vote_reply,
            TimeoutNow: self._on_timeout_now,
            JoinRequest: self._on_join,
            LeaveRequest: self._scheduler_only(lambda n, m, r, t: n.on_leave(m, r, t)),
            LinkRequest: self._scheduler_only(lambda n, m, r, t: n.on_link_request(m, r, t)),
            LinkReport: self._scheduler_only(lambda n, m, r, t: n.on_link_report(m, t)),
            AgentReport: self._scheduler_only(lambda n, m, r, t: n.on_agent_report(m, t)),
            PolicyAck: self._scheduler_only(lambda n, m, r, t: n.on_ack(m, t)),
            ConnectCommand: lambda m, r, t: self.agent.on_connect(m, t),
            ClusterUpdate: self._on_cluster_update,
            Ping: self._on_ping,
            Pong: lambda m, r, t: self.agent.on_pong(m, t),
            BulkData: self._on_bulk_data,
            BulkAck: lambda m, r, t: self.agent.on_bulk_ack(m, t),
            OpResult: self._on_op_result,
            Refusal: self._on_refusal,
            StatusRequest: self._on_status,
            LeaveCommand: lambda m, r, t: self.membership.start_leave(r, t),
            LinkCommand: self._on_link_command,
            FaultCommand: self._on_fault,
            PolicyRequest: self._on_policy_request,
            TrainerRegister: lambda m, r, t: self.trainer.on_register(m, r),
            TrainerInfo: self._scheduler_only(lambda n, m, r, t: n.trainers.on_info(m, r, t)),
            TrainerEvent: self._on_trainer_event,
        }

    def _scheduler_only(
        self, fn: Callable[[Negotiator, Any, ReplyPath | None, float], None]
    ) -> Handler:
        def handler(msg: Any, reply: ReplyPath | None, now: float) -> None:
            if self.negotiator is not None:
                fn(self.negotiator, msg, reply, now)

        return handler

    # -- election --------------------------------------------------------------------------

    def _on_leader_heartbeat(
        self, msg: LeaderHeartbeat, reply: ReplyPath | None, now: float
    ) -> None:
        if self.state != DaemonState.ACTIVE or msg.sender == self.node_id:
            return
        if self.is_scheduler and msg.term <= self.term:
            return  # a stale scheduler; our own heartbeats will make it step down
        was_scheduler = self.is_scheduler
        if self.election.on_leader(msg.term, msg.sender, now) or was_scheduler:
            self.negotiator = None
            self.event("leader_changed", scheduler=msg.sender, term=msg.term)
            self._send_agent_report()

    def _send_agent_report(self) -> None:
        report = self.agent.report(self.view, self.address, self.trainer.report_fields())
        if report is not None:
            self.to_scheduler(report)

    def _on_request_vote(self, msg: RequestVote, reply: ReplyPath | None, now: float) -> None:
        if self.state not in (DaemonState.ACTIVE, DaemonState.LEAVING):
            return  # a leaving member still votes: its own leave may need the new scheduler
        was_scheduler = self.is_scheduler
        answer = self.election.on_request_vote(msg, now, self.epoch)
        if was_scheduler and self.election.role != Role.SCHEDULER:
            self.negotiator = None
            self.event("stepped_down", term=self.term)
        self.respond(reply, answer)

    def _on_vote_reply(self, msg: VoteReply, reply: ReplyPath | None, now: float) -> None:
        was_scheduler = self.is_scheduler
        if self.election.on_vote_reply(msg, now, self.members()):
            self._become_scheduler(now)
        elif was_scheduler and self.election.role != Role.SCHEDULER:
            self.negotiator = None
            self.event("stepped_down", term=self.term)

    def _on_timeout_now(self, msg: TimeoutNow, reply: ReplyPath | None, now: float) -> None:
        # a leaving member takes the handover too: the scheduler that sent it is gone, and its
        # own leave (and anyone else's) needs a scheduler (see _become_scheduler)
        if self.state in (DaemonState.ACTIVE, DaemonState.LEAVING) and not self.is_scheduler:
            self._start_election(now, transfer=True)

    def _start_election(self, now: float, transfer: bool = False) -> None:
        members = self.members()
        if self.node_id not in members:
            self.election.disarm()
            return
        if self.election.leader is not None or self._prev_leader is None:
            leader = self.election.leader or (self.view.scheduler if self.view else None)
            if leader is not None and leader != self.node_id:
                self._prev_leader = (leader, self.election.last_leader_contact)
        rv = self.election.start(now, self.epoch, transfer)
        self.event("election_started", term=self.term, transfer=transfer)
        if self.election.has_majority(members):
            self._become_scheduler(now)
            return
        frame = encode(rv)
        for m in members:
            if m != self.node_id:
                self.transport.send_peer(m, frame)

    def _become_scheduler(self, now: float, bootstrap: bool = False) -> None:
        if bootstrap:
            self.election.term = 1
        self.election.become_scheduler(now)
        self.negotiator = Negotiator(
            self, self.cfg, None if bootstrap else self.view, now, old_scheduler=self._prev_leader
        )
        self.negotiator.trainers.absorb(self.node_id, self.trainer.report_fields())
        self._prev_leader = None
        self.event("elected", term=self.term, epoch=self.epoch)
        self._due["heartbeat"] = now  # announce at once
        self._due["failures"] = now
        if self.state == DaemonState.LEAVING:  # its request went to the old scheduler: ask anew
            self.to_scheduler(self.membership.leave_request())

    # -- membership ------------------------------------------------------------------------

    def _on_join(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        if self.negotiator is not None and self.is_scheduler:
            self.negotiator.on_join(msg, reply, now)
            return
        leader = self.election.leader
        if leader is not None and leader != self.node_id and msg.forwarded_by is None:
            self.send(
                leader, msgspec.structs.replace(msg, forwarded_by=self.node_id, sender=self.node_id)
            )
            return
        if msg.forwarded_by is None:
            reason = Reason.PAUSED if self._paused else Reason.NOT_SCHEDULER
            self.respond(reply, refusal(reason, self._context(), "no scheduler", "join_request"))

    def _on_member_heartbeat(
        self, msg: MemberHeartbeat, reply: ReplyPath | None, now: float
    ) -> None:
        if self.negotiator is not None:
            self.negotiator.on_heartbeat(msg.sender, msg.resources, now)

    def _on_cluster_update(self, msg: ClusterUpdate, reply: ReplyPath | None, now: float) -> None:
        ids = {n.id for n in msg.view.nodes}
        if self.node_id not in ids:
            self.membership.on_dropped_from_view(msg, reply, now)
            return
        if self.state == DaemonState.JOINING:
            self.set_state(DaemonState.ACTIVE)
            self.election.adopt(msg.term, msg.sender, now)
            self.transport.close_contacts()
            self.event("joined", epoch=msg.epoch, term=msg.term, scheduler=msg.sender)
        elif msg.sender != self.node_id and (
            msg.term > self.term or self.election.leader != msg.sender
        ):
            if self.is_scheduler:
                self.negotiator = None
            self.election.on_leader(msg.term, msg.sender, now)
            self.event("leader_changed", scheduler=msg.sender, term=msg.term)
            if self.state == DaemonState.LEAVING:  # the old scheduler may have lost the request
                self.to_scheduler(self.membership.leave_request())
        self._install(msg, now)
        # acknowledge as soon as the view and policy are in place; the event log and metrics
        # come after, off the scheduler's critical path
        self.respond(reply, PolicyAck(sender=self.node_id, epoch=msg.epoch, term=self.term))
        self._record_install(msg)

    def _install(self, msg: ClusterUpdate, now: float) -> None:
        self.view = msg.view
        self.update = msg
        keep = {msg.sender} | {m.cmd.peer for m in self.agent.measurements.values()}
        for n in msg.view.nodes:
            if n.id != self.node_id:
                self.transport.ensure_peer(n.id, n.address)
                keep.add(n.id)
        for peer in list(self.transport.dealers):
            if peer not in keep:
                self.transport.drop_peer(peer)
        self.agent.set_view(msg.view, now)

    def _record_install(self, msg: ClusterUpdate) -> None:
        self.event(
            "view_installed",
            epoch=msg.epoch,
            term=msg.term,
            cause=msg.cause,
            scheduler=msg.view.scheduler,
            members=sorted(n.id for n in msg.view.nodes),
            apply_at=msg.apply_at,
            restart_allreduce=msg.restart_allreduce,
            sync_kind=msg.sync.kind,
            replication_skipped=msg.replication.skipped if msg.replication else None,
        )
        self.metrics.state(
            self.epoch, self.term, len(msg.view.nodes), self.is_scheduler, self._paused
        )

    # -- probes ----------------------------------------------------------------------------

    def _on_ping(self, msg: Ping, reply: ReplyPath | None, now: float) -> None:
        self.respond(reply, Pong(sender=self.node_id, epoch=self.epoch, seq=msg.seq, t=msg.t))

    def _on_bulk_data(self, msg: BulkData, reply: ReplyPath | None, now: float) -> None:
        ack: BulkAck | None = self.agent.on_bulk_data(msg, now)
        if ack is not None:
            self.respond(reply, ack)

    # -- results and refusals --------------------------------------------------------------

    def _on_op_result(self, msg: OpResult, reply: ReplyPath | None, now: float) -> None:
        if self.membership.on_leave_result(msg):
            return
        self.trainer.on_result(msg)
        op = self._clients.pop(msg.op_id, None)
        if op is not None:
            self.respond(op.reply, msgspec.structs.replace(msg, sender=self.node_id))

    def _on_refusal(self, msg: Refusal, reply: ReplyPath | None, now: float) -> None:
        self.event(
            "refused_by_peer",
            peer=msg.sender,
            reason=msg.reason,
            ref_type=msg.ref_type,
            detail=msg.detail,
        )
        op_id = self.trainer.on_refusal(msg)
        op = self._clients.pop(op_id, None) if op_id else None
        if op is not None and op_id:
            self.result(op.reply, op_id, msg.reason, msg.detail or "refused by the scheduler")
        if msg.reason == "stale_term" and msg.term > self.term:
            if self.is_scheduler:
                self.event("stepped_down", term=msg.term)
            self.negotiator = None
            self.election.step_down(msg.term, now)
            return
        if self.state == DaemonState.JOINING and msg.ref_type == "join_request":
            if msg.reason not in ("not_scheduler", "paused"):
                log.error("join refused by %s: %s %s", msg.sender or "?", msg.reason, msg.detail)
                self.event("join_failed", reason=msg.reason, detail=msg.detail)
                self.finish(3)
            return
        if (
            msg.reason == "unknown_peer"
            and msg.ref_type == "request_vote"
            and self.state == DaemonState.ACTIVE
            and self._paused
        ):
            self.membership.rejoin(None, msg.sender, now)  # the cluster moved on without us

    # -- client requests -------------------------------------------------------------------

    def _on_status(self, msg: StatusRequest, reply: ReplyPath | None, now: float) -> None:
        self.respond(reply, status_reply(self))

    def _on_policy_request(self, msg: PolicyRequest, reply: ReplyPath | None, now: float) -> None:
        self.respond(reply, policy_reply(self))

    def _on_fault(self, msg: FaultCommand, reply: ReplyPath | None, now: float) -> None:
        self.faults.apply(msg.name, list(msg.peers))
        self.event("fault", fault=msg.name, peers=list(msg.peers))
        self.respond(
            reply, FaultReply(sender=self.node_id, epoch=self.epoch, active=self.faults.describe())
        )

    def _on_link_command(self, msg: LinkCommand, reply: ReplyPath | None, now: float) -> None:
        op_id = uuid.uuid4().hex[:12]
        if msg.peer == self.node_id or self.state != DaemonState.ACTIVE:
            why = "itself" if msg.peer == self.node_id else f"while {self.state.value}"
            self.result(reply, op_id, Reason.BAD_REQUEST, f"cannot link {why}")
            return
        # connect-link: measure the new link while the request travels to the scheduler
        # (saves the scheduler's order to measure it, a round trip on the critical path)
        address = self._view_address(msg.peer) if msg.op == "connect" else None
        req = LinkRequest(
            sender=self.node_id,
            epoch=self.epoch,
            a=self.node_id,
            b=msg.peer,
            op=msg.op,
            op_id=op_id,
            premeasured=address is not None,
        )
        self.relay(reply, req, op_id)
        if address is not None and op_id in self._clients:
            self.agent.on_connect(
                ConnectCommand(
                    sender=self.node_id,
                    epoch=self.epoch,
                    term=self.term,
                    peer=msg.peer,
                    address=address,
                    measure_bandwidth=False,
                    op_id="pre-" + op_id,
                ),
                now,
            )

    def _view_address(self, peer: str) -> str | None:
        """The control address of ``peer`` in the installed view (``None``: not a member)."""
        if self.view is None:
            return None
        return next((n.address for n in self.view.nodes if n.id == peer), None)

    def _on_trainer_event(self, msg: TrainerEvent, reply: ReplyPath | None, now: float) -> None:
        if msg.node_id is None:  # from the local trainer
            self.trainer.on_event(msg, reply)
        elif self.negotiator is not None:  # forwarded by a member
            self.negotiator.trainers.on_event(msg, reply, now)

    def finish(self, code: int) -> None:
        """Stops the loop; :meth:`run` then returns ``code``."""
        self.exit_code = code
        self._stop = True
        if self.state != DaemonState.STOPPED:
            self.state = DaemonState.STOPPED
