"""The daemon: one single-threaded event loop over ZeroMQ sockets and a few timers.

The loop polls the sockets with a timeout equal to the time to the next timer (heartbeat, link
probe, election timeout, failure check, housekeeping), so an idle daemon sleeps in ``zmq_poll``.
Every inbound frame goes through :func:`chaos.protocol.validate` and then to one handler chosen by
message type (:class:`~chaos.daemon.dispatch.Dispatcher`). Messages a node sends to itself (the
scheduler is also a member) go through a local queue, never through recursion.

:class:`Daemon` owns the lifecycle and the loop, and wires the collaborators that do the work,
each with one job (the daemon is the one host they all see):

* :class:`~chaos.daemon.outbox.Outbox`: sends to peers, replies, the local queue;
* :class:`~chaos.daemon.succession.Succession`: elections, heartbeats, and the
  :class:`~chaos.daemon.scheduler.role.SchedulerRole` while this node holds it;
* :class:`~chaos.daemon.views.ViewInstaller`: the installed view and its acknowledgement;
* :class:`~chaos.daemon.membership.Membership`: this node's own join and leave;
* :class:`~chaos.daemon.agent.Agent`: link probes, measurements, resources;
* :class:`~chaos.daemon.client_ops.ClientRequests`: the local clients' requests;
* :class:`~chaos.daemon.relay.TrainerRelay` and :class:`~chaos.daemon.notices.PolicyNotices`:
  the local trainer's endpoint.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from chaos.daemon.agent import Agent
from chaos.daemon.client_ops import ClientRequests
from chaos.daemon.config import DaemonConfig, ensure_private_run_dir, parse_fault_spec
from chaos.daemon.dispatch import Dispatcher, Handler
from chaos.daemon.election import Election
from chaos.daemon.events import EventLog
from chaos.daemon.membership import Membership
from chaos.daemon.metrics import Metrics, ServerLimits, metrics_token
from chaos.daemon.notices import PolicyNotices
from chaos.daemon.outbox import Outbox
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.scheduler.monitor import ClusterMonitor
from chaos.daemon.scheduler.role import SchedulerRole
from chaos.daemon.states import DAEMON_TRANSITIONS, DaemonState, Role
from chaos.daemon.succession import Succession
from chaos.daemon.timers import Timers
from chaos.daemon.transport import FaultInjector, ReplyPath, Transport
from chaos.daemon.views import ViewInstaller
from chaos.daemon.vote_certs import VoteBook, VoteSigner

from chaos.errors import ChaosError
from chaos.protocol import (
    AgentReport,
    BulkAck,
    BulkData,
    CaughtUp,
    ClusterUpdate,
    ClusterView,
    ConnectCommand,
    EventEntry,
    FaultCommand,
    JoinRequest,
    LeaveCommand,
    LeaveRequest,
    LinkCommand,
    LinkReport,
    LinkRequest,
    MemberHeartbeat,
    Message,
    NonfiniteStep,
    OpResult,
    Ping,
    PolicyAck,
    PolicyRequest,
    Pong,
    PullDone,
    Reason,
    Refusal,
    RequestVote,
    SchedulerHeartbeat,
    StatusRequest,
    StepFailed,
    TimeoutNow,
    TrainerGone,
    TrainerInfo,
    TrainerProgress,
    TrainerReady,
    TrainerRegister,
    TrainerThroughput,
    Vote,
    VoteReply,
    refusal,
)
from chaos.protocol.messages import AuditInfo
from chaos.protocol.states import TrainerPhase
from chaos.security import Security

log = logging.getLogger("chaos.daemon")

_HOUSEKEEPING_S = 0.1
_MEASURE_TICK_S = 0.005
_MAX_POLL_S = 1.0


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
        ensure_private_run_dir(cfg.run_dir)
        self.events = EventLog(cfg.resolved_event_log, cfg.node_id)
        self.security = Security.from_key_file(cfg.cluster_key)
        self.metrics = Metrics(
            cfg.node_id, cfg.metrics_port, cfg.resolved_metrics_host,
            token=metrics_token(self.security.cluster) if self.security.cluster else None,
            limits=ServerLimits(cfg.metrics_max_connections, cfg.metrics_idle_timeout_s,
                                cfg.metrics_threads),
        )  # fmt: skip
        self.public_key = self.security.public_key if self.security.enabled else ""
        """This daemon's CURVE public key, bound to its id at admission (empty: no key)."""
        self.votes = VoteBook(cfg.node_id, VoteSigner() if self.security.enabled else None)
        self.sign_key = self.votes.sign_key
        self.incarnation = uuid.uuid4().hex[:12]  # this process's nonce (JoinRequest)
        """This daemon's vote-signing key, bound to its id with ``public_key`` (empty: none)."""
        self.transport = Transport(
            cfg.listen, cfg.resolved_ipc_endpoint, cfg.max_frame_bytes, self.faults,
            self.security,
        )  # fmt: skip
        self.transport.max_dealers = cfg.max_peer_sockets
        self.transport.on_refused = self.metrics.refused
        self.state = DaemonState.STARTING
        self.exit_code = 0
        self.election = Election(cfg.node_id, cfg, rng)
        self.timers = Timers(on_error=self.internal_error)
        self.outbox = Outbox(cfg.node_id, self.transport, self._known_scheduler)
        self.agent = Agent(self, cfg)
        self.trainer = TrainerRelay(self)
        self.membership = Membership(self)
        self.requests = ClientRequests(self, self.faults, self.agent, self.trainer)
        self.succession = Succession(
            self,
            self.election,
            self.transport,
            self.timers,
            self.agent,
            self.trainer,
            self.metrics,
            self.membership.leave_request,
            self.votes,
        )
        self.views = ViewInstaller(
            self,
            self.election,
            self.succession,
            self.membership,
            self.transport,
            self.agent,
            self.metrics,
        )
        self.notices = PolicyNotices(self, self.transport, self.timers)
        self.dispatcher = Dispatcher(self, self.transport, self.faults, self.metrics, self.events)
        self.dispatcher.register(self._handler_table())
        self._stop = False
        self._leave_requested = False

    # -- what the collaborators read -------------------------------------------------------

    @property
    def view(self) -> ClusterView | None:
        """The installed cluster view (``None`` before any)."""
        return self.views.view

    @property
    def update(self) -> ClusterUpdate | None:
        """The installed update, with its policies (``None`` before any)."""
        return self.views.update

    @property
    def epoch(self) -> int:
        """The installed view's epoch (0 before any)."""
        return self.view.epoch if self.view is not None else 0

    @property
    def term(self) -> int:
        """The current election term."""
        return self.election.term

    @property
    def role(self) -> Role:
        """This node's election role."""
        return self.election.role

    @property
    def is_scheduler(self) -> bool:
        """Whether this node is the scheduler."""
        return self.succession.is_scheduler

    @property
    def scheduler_monitor(self) -> ClusterMonitor | None:
        """The scheduler role's cluster monitor (``None``: not the scheduler)."""
        role = self.succession.role
        return role.monitor if role is not None else None

    @property
    def membership_version(self) -> object:
        """Changes whenever the scheduler's membership may have (``None`` on a member)."""
        role = self.succession.role
        return (role, role.monitor.version) if role is not None else None

    @property
    def measured(self) -> dict[str, tuple[float | None, float | None]]:
        """This node's latest measurement of each of its links, by peer."""
        return self.agent.measured

    @property
    def notify_endpoint(self) -> str | None:
        """Where the policy notices are published."""
        return self.transport.notify_endpoint

    @property
    def active(self) -> bool:
        """Whether this daemon is an active member."""
        return self.state == DaemonState.ACTIVE

    @property
    def paused(self) -> bool:
        """Whether this member pauses (no scheduler with a majority)."""
        return self.state == DaemonState.ACTIVE and self.election.paused

    @property
    def refused(self) -> int:
        """Inbound frames refused so far."""
        return self.dispatcher.refused

    @property
    def trainer_audit(self) -> AuditInfo | None:
        """The local trainer's last reported state audit (``status``)."""
        return self.trainer.audit

    @property
    def trainer_phase(self) -> TrainerPhase | None:
        """The local trainer's last reported lifecycle phase (``status``)."""
        return self.trainer.phase

    def recent_events(self) -> list[EventEntry]:
        """This daemon's most recent events, oldest first (``status``)."""
        return self.events.recent()

    def status_notes(self) -> list[str]:
        """The lines ``status`` adds: a trainer that exited, restarts that keep failing."""
        role = self.succession.role
        return self.trainer.notes() + (role.trainers.notes() if role is not None else [])

    def _known_scheduler(self) -> str | None:
        return self.node_id if self.is_scheduler else self.election.scheduler

    @property
    def vote_cert(self) -> list[Vote]:
        """The signed votes this node won the current term with (its updates carry them)."""
        return self.succession.vote_cert

    def scheduler_problem(self, msg: Message) -> str | None:
        """Why a scheduler's message is not taken from its sender (``None``: it is); see
        :mod:`chaos.daemon.vote_certs`. A joining node takes its admission as it comes: it has
        no view to check against yet."""
        if self.state == DaemonState.JOINING:
            return None
        return self.succession.scheduler_problem(msg)

    def members(self) -> list[str]:
        """Current membership (the scheduler's monitor, else the installed view)."""
        monitor = self.scheduler_monitor
        if monitor is not None:
            return monitor.members()
        return [n.id for n in self.view.nodes] if self.view is not None else []

    # -- the ways out ----------------------------------------------------------------------

    def send(self, peer: str, msg: Message, attachment: bytes | None = None) -> bool:
        """Sends to a peer (see :meth:`Outbox.send`)."""
        return self.outbox.send(peer, msg, attachment)

    def broadcast(self, peers: dict[str, str], msg: Message) -> None:
        """Sends one message to several peers (see :meth:`Outbox.broadcast`)."""
        self.outbox.broadcast(peers, msg)

    def to_scheduler(self, msg: Message) -> bool:
        """Sends to the scheduler; ``False`` when none is known."""
        return self.outbox.to_scheduler(msg)

    def respond(self, reply: ReplyPath | None, msg: Message) -> None:
        """Answers on an inbound frame's path (``None``: a local message)."""
        self.outbox.respond(reply, msg)

    def result(
        self, reply: ReplyPath | None, op_id: str, reason: Reason | None = None, detail: str = ""
    ) -> None:
        """Answers a client with an :class:`OpResult` (failed when ``reason`` is given)."""
        self.requests.result(reply, op_id, reason, detail)

    def relay(self, reply: ReplyPath | None, msg: Message, op_id: str) -> None:
        """Sends a client's request to the scheduler (see :meth:`ClientRequests.relay`)."""
        self.requests.relay(reply, msg, op_id)

    def send_to_address(self, peer: str, address: str, msg: Message) -> None:
        """Opens a DEALER to ``peer`` if needed and sends."""
        self.outbox.send_to_address(peer, address, msg)

    def connect_peer(self, peer: str, address: str) -> bool:
        """Opens the DEALER to ``peer``; ``True`` when it was already open."""
        return self.outbox.connect_peer(peer, address)

    def event(self, name: str, **fields: object) -> None:
        """Logs an event to the JSONL log and the ``logging`` module."""
        self.events.emit(name, **fields)
        log.info("%s %s %s", self.node_id, name, fields if fields else "")

    def internal_error(self, where: str, what: str, exc: BaseException) -> None:
        """Counts and records an exception the loop survived (already logged with its
        traceback)."""
        self.metrics.error(where)
        self.events.emit(f"{where}_error", type=what, error=repr(exc)[:300])

    def peer_address(self, peer: str) -> str | None:
        """The address this node's DEALER to ``peer`` points at (``None``: none open)."""
        cur = self.transport.dealers.get(peer)
        return cur[0] if cur is not None else None

    def observe_primitive(self, name: str, seconds: float) -> None:
        """Records a primitive's control-path time."""
        self.metrics.primitive(name, seconds)

    # -- lifecycle -------------------------------------------------------------------------

    def lost_quorum(self) -> None:
        """The scheduler no longer hears a majority: step down and pause."""
        self.succession.lose_quorum(time.monotonic())

    def drop_scheduler_role(self) -> None:
        """Forgets the scheduler role without an event (this node joins a cluster)."""
        self.succession.drop_role()

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

    def finish(self, code: int) -> None:
        """Stops the loop; :meth:`run` then returns ``code``."""
        self.exit_code = code
        self._stop = True
        if self.state != DaemonState.STOPPED:
            self.state = DaemonState.STOPPED

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs until the node left or failed to join.

        Returns:
            The exit code: 0 after a leave, 3 if the join was refused, 4 if it timed out.

        Raises:
            BaseException: whatever ended the loop unexpectedly, after the ``stopped`` event
                recorded the exit code it ends the process with (1, or a ``SystemExit``'s).
        """
        now = time.monotonic()
        self.event(
            "started",
            address=self.address,
            ipc=self.transport.ipc_endpoint,
            join=",".join(self.cfg.join) or None,
        )
        if not self.cfg.join:
            self.set_state(DaemonState.ACTIVE)
            self.succession.become_scheduler(now, bootstrap=True)
        else:
            self.membership.begin_join(now, self.cfg.join, list(self.cfg.neighbors))
        try:
            while not self._stop:
                self._guarded_step()
        except BaseException as exc:  # recorded, then the process dies of it
            self.exit_code = _exit_code_of(exc)
            log.critical("the daemon's loop ended: %r", exc)
            raise
        finally:
            self.event("stopped", exit_code=self.exit_code)
            self.transport.close(linger_s=0.2)
            self.metrics.close()
            self.events.close()
        return self.exit_code

    def _guarded_step(self) -> None:
        """One loop step; an exception that escapes every finer guard is survived too."""
        try:
            self._step()
        except Exception as exc:  # a bug must not take the control plane down
            log.exception("loop step failed")
            self.internal_error("loop", "step", exc)
            time.sleep(0.01)  # a step that fails at once every time must not spin

    def _step(self) -> None:
        now = time.monotonic()
        if self._leave_requested:
            self._leave_requested = False
            self.timers.call("leave", self.membership.start_leave, None, now)
        self._run_timers(now)
        timeout = 0.0 if self.outbox.local else max(0.0, self.timers.next() - time.monotonic())
        for inbound in self.transport.poll(min(timeout, _MAX_POLL_S)):
            if self._stop:  # left: commit nothing more that it could not see through
                break
            self.dispatcher.on_frame(inbound, time.monotonic())
        local = self.outbox.local
        while local and not self._stop:
            self.dispatcher.dispatch(local.popleft(), None, time.monotonic())
        # a new scheduler gets the requests the old one left unanswered
        self.timers.call(
            "follow_scheduler",
            self.requests.follow_scheduler,
            self._known_scheduler(),
            self.term,
            time.monotonic(),
        )
        self.timers.call("notices", self.notices.publish, now)  # trainers hear without asking

    def _run_timers(self, now: float) -> None:
        t = self.timers
        # every job runs under Timers.call: one that raises is logged and counted, and the
        # others (and the loop) go on
        if t.is_due("heartbeat", now):
            t.set("heartbeat", now + self.cfg.heartbeat_interval_s)
            t.call("heartbeat", self.succession.heartbeat, now)
            # a trainer process that exited leaves the policy
            t.call("check_trainer", self.trainer.check_trainer)
        if t.is_due("probe", now):
            t.set("probe", now + self.cfg.link_probe_interval_s)
            if self.state == DaemonState.ACTIVE:
                t.call("probe", self.agent.probe_links, now)
        if t.is_due("resources", now):
            t.set("resources", now + self.cfg.resource_interval_s)
            t.call("resources", self.agent.sample_resources)
        if t.is_due("housekeeping", now):
            t.set("housekeeping", now + _HOUSEKEEPING_S)
            t.call("housekeeping", self._housekeeping, now)
        if self.agent.busy:
            t.call("measurements", self.agent.tick_measurements, now)
        t.set("measure", now + _MEASURE_TICK_S if self.agent.busy else now + _MAX_POLL_S)
        if self.state == DaemonState.ACTIVE and not self.is_scheduler:
            if now >= self.election.deadline:
                t.call("election", self.succession.start_election, now)
            t.set("election", self.election.deadline)
        else:
            t.set("election", now + _MAX_POLL_S)
        if not t.call("failures", self._run_failure_timer, now):
            t.set("failures", now + self.cfg.heartbeat_interval_s)

    def _run_failure_timer(self, now: float) -> None:
        role = self.succession.role
        if role is None:
            self.timers.set("failures", now + _MAX_POLL_S)
            return
        nxt = min(role.next_failure_deadline(), role.rebuild_deadline)
        if now >= nxt or self.timers.is_due("failures", now):
            role.check_failures(now)
        role = self.succession.role  # a lost quorum gave the role up
        if role is not None:
            deadline = min(role.next_failure_deadline(), now + self.cfg.heartbeat_interval_s)
            self.timers.set("failures", max(now + 0.001, deadline))

    def _housekeeping(self, now: float) -> None:
        if self.succession.role is not None:
            self.succession.role.tick(now)
        self.requests.expire(now)
        self.membership.tick(now)

    # -- handlers --------------------------------------------------------------------------

    def _handler_table(self) -> dict[type, Handler]:
        s, a, r, relay = self.succession, self.agent, self.requests, self.trainer
        answer = lambda n, m, rp, now: n.trainers.on_event(m, rp, now)  # noqa: E731
        return {
            SchedulerHeartbeat: s.on_scheduler_heartbeat,
            MemberHeartbeat: self._on_member_heartbeat,
            RequestVote: self._on_request_vote,
            VoteReply: s.on_vote_reply,
            TimeoutNow: self._on_timeout_now,
            JoinRequest: self._on_join,
            LeaveRequest: self._scheduler_only(lambda n, m, r, t: n.on_leave(m, r, t)),
            LinkRequest: self._scheduler_only(lambda n, m, r, t: n.on_link_request(m, r, t)),
            LinkReport: self._scheduler_only(lambda n, m, r, t: n.on_link_report(m, t)),
            AgentReport: self._scheduler_only(lambda n, m, r, t: n.on_agent_report(m, t)),
            PolicyAck: self._scheduler_only(lambda n, m, r, t: n.on_ack(m, t)),
            ConnectCommand: lambda m, r, t: a.on_connect(m, t),  # never re-points a peer
            ClusterUpdate: self.views.on_cluster_update,
            Ping: self._on_ping,
            Pong: lambda m, r, t: a.on_pong(m, t),
            BulkData: self._on_bulk_data,
            BulkAck: lambda m, r, t: a.on_bulk_ack(m, t),
            OpResult: self._on_op_result,
            Refusal: self._on_refusal,
            StatusRequest: r.on_status,
            LeaveCommand: lambda m, r, t: self.membership.start_leave(r, t),
            LinkCommand: r.on_link_command,
            FaultCommand: r.on_fault,
            PolicyRequest: r.on_policy_request,
            TrainerRegister: lambda m, r, t: self.trainer.on_register(m, r),
            TrainerInfo: self._scheduler_only(lambda n, m, r, t: n.trainers.on_info(m, r, t)),
            # trainer events: the local trainer's (no node_id) go to the relay, a member's
            # forwarded ones (node_id set) to the scheduler role
            TrainerReady: self._trainer_event(relay.on_event, answer),
            PullDone: self._trainer_event(relay.on_event, answer),
            CaughtUp: self._trainer_event(relay.on_event, answer),
            StepFailed: self._trainer_event(relay.on_event, SchedulerRole.on_step_failed),
            TrainerGone: self._trainer_event(relay.on_event, SchedulerRole.on_trainer_gone),
            TrainerProgress: self._trainer_event(
                lambda m, rp: relay.on_progress(m),
                lambda n, m, rp, now: n.on_trainer_progress(m, now),
            ),
            NonfiniteStep: self._trainer_event(
                lambda m, rp: relay.on_nonfinite(m),
                lambda n, m, rp, now: n.on_nonfinite(m, now),
            ),
            TrainerThroughput: self._trainer_event(
                lambda m, rp: relay.on_throughput(m),
                lambda n, m, rp, now: n.trainers.on_throughput(m),
            ),
        }

    def _scheduler_only(
        self, fn: Callable[[SchedulerRole, Any, ReplyPath | None, float], None]
    ) -> Handler:
        def handler(msg: Any, reply: ReplyPath | None, now: float) -> None:
            if self.succession.role is not None:
                fn(self.succession.role, msg, reply, now)

        return handler

    def _on_join(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        role = self.succession.role
        if role is not None and self.is_scheduler:
            role.on_join(msg, reply, now)
            return
        scheduler = self.election.scheduler
        if scheduler is not None and scheduler != self.node_id and msg.forwarded_by is None:
            fwd = msgspec.structs.replace(msg, forwarded_by=self.node_id, sender=self.node_id)
            self.send(scheduler, fwd)
            return
        if msg.forwarded_by is None:  # the joiner's next contacts: the members this node knows
            reason = Reason.PAUSED if self.paused else Reason.NOT_SCHEDULER
            no = refusal(reason, self.dispatcher.context(), "no scheduler", "join_request")
            others = self.membership.contacts_for(msg.address)
            self.respond(reply, msgspec.structs.replace(no, members=others))

    def _on_request_vote(self, msg: RequestVote, reply: ReplyPath | None, now: float) -> None:
        """A vote request; one marked ``transfer`` skips the stickiness rule only when
        :meth:`Election.honours_transfer` says so."""
        if msg.transfer and not self.election.honours_transfer(msg, self.members()):
            self.event("transfer_ignored", peer=msg.sender, term=msg.term,
                       scheduler=self.election.scheduler)  # fmt: skip
            msg = msgspec.structs.replace(msg, transfer=False)
        self.succession.on_request_vote(msg, reply, now)

    def _on_timeout_now(self, msg: TimeoutNow, reply: ReplyPath | None, now: float) -> None:
        """A handover, obeyed only from the scheduler this node follows."""
        if not self.election.honours_handover(msg.sender):
            self.event("handover_ignored", peer=msg.sender, scheduler=self.election.scheduler)
            return
        self.succession.on_timeout_now(msg, reply, now)

    def _on_member_heartbeat(
        self, msg: MemberHeartbeat, reply: ReplyPath | None, now: float
    ) -> None:
        if self.succession.role is not None:
            self.succession.role.on_heartbeat(msg.sender, msg.resources, now)

    def _on_ping(self, msg: Ping, reply: ReplyPath | None, now: float) -> None:
        self.respond(reply, Pong(sender=self.node_id, epoch=self.epoch, seq=msg.seq, t=msg.t))

    def _on_bulk_data(self, msg: BulkData, reply: ReplyPath | None, now: float) -> None:
        ack: BulkAck | None = self.agent.on_bulk_data(msg, now)
        if ack is not None:
            self.respond(reply, ack)

    def _on_op_result(self, msg: OpResult, reply: ReplyPath | None, now: float) -> None:
        if self.membership.on_leave_result(msg):
            return
        self.trainer.on_result(msg)
        self.requests.on_result(msg)

    def _on_refusal(self, msg: Refusal, reply: ReplyPath | None, now: float) -> None:
        self.event(
            "refused_by_peer",
            peer=msg.sender,
            reason=msg.reason,
            ref_type=msg.ref_type,
            detail=msg.detail,
        )
        op_id = self.trainer.on_refusal(msg)
        if op_id:
            self.requests.refused(op_id, msg.reason, msg.detail or "refused by the scheduler")
        if msg.reason == "stale_term" and msg.term > self.term and msg.sender in self.members():
            # only a member's (its id is bound to its key): a stranger's forged refusal with a
            # higher term would depose the scheduler, over and over
            self.succession.on_stale_term(msg.term, now)
            return
        if self.membership.on_refusal(msg):
            return
        if (
            msg.reason == "unknown_peer"
            and msg.ref_type == "request_vote"
            and self.state == DaemonState.ACTIVE
            and self.paused
        ):
            self.membership.rejoin(None, msg.sender, now)  # the cluster moved on without us

    def _trainer_event(
        self,
        local: Callable[[Any, ReplyPath | None], None],
        forwarded: Callable[[SchedulerRole, Any, ReplyPath | None, float], None],
    ) -> Handler:
        """A trainer event's handler: ``local`` (the relay's) for one from this node's trainer
        (``node_id`` unset), ``forwarded`` (the scheduler role's) for one a member forwarded."""

        def handler(msg: Any, reply: ReplyPath | None, now: float) -> None:
            if msg.node_id is None:  # from the local trainer
                local(msg, reply)
            elif self.succession.role is not None:  # forwarded by a member
                forwarded(self.succession.role, msg, reply, now)

        return handler


def _exit_code_of(exc: BaseException) -> int:
    """The exit code a process ends with when ``exc`` escapes (1 but for a ``SystemExit``)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 1
