"""The daemon: one single-threaded event loop over ZeroMQ sockets and a few timers.

The loop polls the sockets with a timeout equal to the time to the next timer (heartbeat, link
probe, election timeout, failure check, housekeeping), so an idle daemon sleeps in ``zmq_poll``.
Every inbound frame goes through :func:`chaos.protocol.validate` and then to the one handler of
its message type (:class:`~chaos.daemon.dispatch.Dispatcher`). Messages a node sends to itself
(the scheduler is also a member) go through a local queue, never through recursion.

:class:`Daemon` owns the loop and wires the flows. Each flow builds, sends and handles its own
messages, the member's side and the scheduler's side together, and exports its handlers as a
table keyed by message type; the loop merges the tables, one handler per type
(:func:`~chaos.daemon.dispatch.merge_handlers`). Every flow works through one
:class:`~chaos.daemon.context.Context` (the node's facts, the outbox, events, timers, metrics):

* :class:`~chaos.daemon.succession.Succession`: election and succession, heartbeats;
* :class:`~chaos.daemon.membership.Membership`: join and leave;
* :class:`~chaos.daemon.views.ViewInstaller`: the installed view and its acknowledgement;
* :class:`~chaos.daemon.agent.Agent`: links (probes, measurements, resources);
* :class:`~chaos.daemon.relay.TrainerRelay`: trainers (and
  :class:`~chaos.daemon.notices.PolicyNotices`, the policy notices to them);
* :class:`~chaos.daemon.client_ops.ClientRequests`: status and the local clients' commands,
  with :class:`~chaos.daemon.relayed.RelayedOps`, the requests relayed to the scheduler;
* :class:`~chaos.daemon.answers.Answers`: results and refusals from peers.
"""

from __future__ import annotations

import logging
import random
import time
import uuid

from chaos.daemon.agent import Agent
from chaos.daemon.answers import Answers
from chaos.daemon.client_ops import ClientRequests
from chaos.daemon.config import DaemonConfig, ensure_private_run_dir, parse_fault_spec
from chaos.daemon.context import Context, NodeFacts
from chaos.daemon.dispatch import Dispatcher, merge_handlers
from chaos.daemon.election import Election
from chaos.daemon.events import EventLog
from chaos.daemon.membership import Membership
from chaos.daemon.metrics import Metrics, ServerLimits, metrics_token
from chaos.daemon.notices import PolicyNotices
from chaos.daemon.outbox import Outbox
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.relayed import RelayedOps
from chaos.daemon.scheduler.role import DaemonContext, DaemonFacts
from chaos.daemon.states import DaemonState
from chaos.daemon.succession import Succession
from chaos.daemon.timers import Timers
from chaos.daemon.transport import FaultInjector, Transport
from chaos.daemon.views import ViewInstaller
from chaos.daemon.vote_certs import VoteBook, VoteSigner

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
        faults = FaultInjector()
        for spec in cfg.faults:
            name, peers = parse_fault_spec(spec)
            faults.apply(name, peers)
        ensure_private_run_dir(cfg.run_dir)
        events = EventLog(cfg.resolved_event_log, cfg.node_id)
        security = Security.from_key_file(cfg.cluster_key)
        self.metrics = Metrics(
            cfg.node_id, cfg.metrics_port, cfg.resolved_metrics_host,
            token=metrics_token(security.cluster) if security.cluster else None,
            limits=ServerLimits(cfg.metrics_max_connections, cfg.metrics_idle_timeout_s,
                                cfg.metrics_threads),
        )  # fmt: skip
        votes = VoteBook(cfg.node_id, VoteSigner() if security.enabled else None)
        self.transport = transport = Transport(
            cfg.listen, cfg.resolved_ipc_endpoint, cfg.max_frame_bytes, faults, security
        )
        transport.max_dealers = cfg.max_peer_sockets
        transport.on_refused = self.metrics.refused
        public_key = security.public_key if security.enabled else ""
        facts: DaemonFacts = NodeFacts(cfg, Election(cfg.node_id, cfg, rng), votes, public_key,
                                       incarnation=uuid.uuid4().hex[:12])  # fmt: skip
        timers = Timers()
        outbox = Outbox(cfg.node_id, transport, lambda: facts.scheduler)
        self.ctx = ctx = Context(facts, outbox, events, timers, self.metrics)
        timers.on_error = ctx.internal_error
        self._wire(ctx, transport, faults)
        self._leave_requested = False

    def _wire(self, ctx: DaemonContext, transport: Transport, faults: FaultInjector) -> None:
        """Builds the flows and merges their handler tables into the dispatcher."""
        self.agent = Agent(ctx, ctx.cfg)
        self.relayed = RelayedOps(ctx)
        self.trainer = TrainerRelay(ctx, self.relayed)
        self.membership = Membership(ctx, transport)
        self.requests = ClientRequests(ctx, self.relayed, faults, self.agent, self.trainer,
                                       transport)  # fmt: skip
        self.succession = Succession(ctx, transport, self.agent, self.trainer,
                                     self.membership.leave_request)  # fmt: skip
        self.views = ViewInstaller(ctx, self.succession, self.membership, transport, self.agent)
        self.notices = PolicyNotices(ctx, transport)
        answers = Answers(ctx, self.relayed, self.trainer, self.membership, self.succession)
        self.dispatcher = Dispatcher(ctx, transport, faults)
        self.dispatcher.register(merge_handlers(
            self.succession.handlers(), self.membership.handlers(), self.views.handlers(),
            self.agent.handlers(), self.trainer.handlers(), self.requests.handlers(),
            answers.handlers(),
        ))  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------

    def request_leave(self) -> None:
        """Asks the loop to leave gracefully (safe from a signal handler)."""
        self._leave_requested = True

    def finish(self, code: int) -> None:
        """Stops the loop; :meth:`run` then returns ``code``."""
        self.ctx.facts.finish(code)

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs until the node left or failed to join.

        Returns:
            The exit code: 0 after a leave, 3 if the join was refused, 4 if it timed out.

        Raises:
            BaseException: whatever ended the loop unexpectedly, after the ``stopped`` event
                recorded the exit code it ends the process with (1, or a ``SystemExit``'s).
        """
        ctx, facts, now = self.ctx, self.ctx.facts, time.monotonic()
        ctx.event("started", address=facts.address, ipc=self.transport.ipc_endpoint,
                  join=",".join(ctx.cfg.join) or None)  # fmt: skip
        if not ctx.cfg.join:
            facts.set_state(DaemonState.ACTIVE)
            self.succession.become_scheduler(now, bootstrap=True)
        else:
            self.membership.begin_join(now, ctx.cfg.join, list(ctx.cfg.neighbors))
        try:
            while not facts.stopping:
                self._guarded_step()
        except BaseException as exc:  # recorded, then the process dies of it
            facts.exit_code = _exit_code_of(exc)
            log.critical("the daemon's loop ended: %r", exc)
            raise
        finally:
            ctx.event("stopped", exit_code=facts.exit_code)
            self.transport.close(linger_s=0.2)
            self.metrics.close()
            ctx.events.close()
        return facts.exit_code

    def _guarded_step(self) -> None:
        """One loop step; an exception that escapes every finer guard is survived too."""
        try:
            self._step()
        except Exception as exc:  # a bug must not take the control plane down
            log.exception("loop step failed")
            self.ctx.internal_error("loop", "step", exc)
            time.sleep(0.01)  # a step that fails at once every time must not spin

    def _step(self) -> None:
        ctx, facts, timers, now = self.ctx, self.ctx.facts, self.ctx.timers, time.monotonic()
        if self._leave_requested:
            self._leave_requested = False
            timers.call("leave", self.membership.start_leave, None, now)
        self._run_timers(now)
        local = ctx.out.local
        timeout = 0.0 if local else max(0.0, timers.next() - time.monotonic())
        for inbound in self.transport.poll(min(timeout, _MAX_POLL_S)):
            if facts.stopping:  # left: commit nothing more that it could not see through
                break
            self.dispatcher.on_frame(inbound, time.monotonic())
        while local and not facts.stopping:
            self.dispatcher.dispatch(local.popleft(), None, time.monotonic())
        # a new scheduler gets the requests the old one left unanswered
        timers.call("follow_scheduler", self.relayed.follow_scheduler, facts.scheduler,
                    facts.term, time.monotonic())  # fmt: skip
        timers.call("notices", self.notices.publish, now)  # trainers hear without asking

    def _run_timers(self, now: float) -> None:
        t, cfg, facts = self.ctx.timers, self.ctx.cfg, self.ctx.facts
        # every job runs under Timers.call: one that raises is logged and counted, and the
        # others (and the loop) go on
        if t.is_due("heartbeat", now):
            t.set("heartbeat", now + cfg.heartbeat_interval_s)
            t.call("heartbeat", self.succession.heartbeat, now)
            # a trainer process that exited leaves the policy
            t.call("check_trainer", self.trainer.check_trainer)
        if t.is_due("probe", now):
            t.set("probe", now + cfg.link_probe_interval_s)
            if facts.active:
                t.call("probe", self.agent.probe_links, now)
        if t.is_due("resources", now):
            t.set("resources", now + cfg.resource_interval_s)
            t.call("resources", self.agent.sample_resources)
        if t.is_due("housekeeping", now):
            t.set("housekeeping", now + _HOUSEKEEPING_S)
            t.call("housekeeping", self._housekeeping, now)
        if self.agent.busy:
            t.call("measurements", self.agent.tick_measurements, now)
        t.set("measure", now + _MEASURE_TICK_S if self.agent.busy else now + _MAX_POLL_S)
        if facts.active and not facts.is_scheduler:
            if now >= facts.election.deadline:
                t.call("election", self.succession.start_election, now)
            t.set("election", facts.election.deadline)
        else:
            t.set("election", now + _MAX_POLL_S)
        if not t.call("failures", self.succession.check_failures, now):
            t.set("failures", now + cfg.heartbeat_interval_s)

    def _housekeeping(self, now: float) -> None:
        role = self.ctx.facts.role
        if role is not None:
            role.tick(now)
        self.relayed.expire(now)
        self.membership.tick(now)


def _exit_code_of(exc: BaseException) -> int:
    """The exit code a process ends with when ``exc`` escapes (1 but for a ``SystemExit``)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 1
