"""The trainer's session with its local daemon: registration, the sync policy, notices.

A :class:`DaemonSession` is the trainer's only link to the control plane. It registers the
trainer's data-plane endpoints, fetches the policy in force, waits for a policy that satisfies a
condition, and follows the notices the daemon publishes (:mod:`chaos.trainer.policy_watch`) so
that the trainer asks for the policy only when a notice names a newer epoch (or the notices fall
silent). It reports the trainer's events (``ready``, ``step_failed``) and the graceful leave to
the daemon, and the trainer's step progress (:class:`StepBeacon`), from which the scheduler
finds a trainer that holds the others up. It neither installs a policy nor touches the data
plane: it hands the trainer a :class:`Policy`, and the trainer decides what to do with it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from chaos.collectives import Topology
from chaos.errors import ChaosError, ChaosTimeout, ProtocolError
from chaos.protocol import (
    AnsweredEvent,
    CaughtUp,
    NonfiniteStep,
    OpResult,
    PolicyReply,
    PullDone,
    ReplicationWire,
    StatusReply,
    StepFailed,
    TrainerPhase,
    TrainerProgress,
    TrainerReady,
    TrainerRegister,
    encode,
)
from chaos.protocol.messages import (
    MAX_ELAPSED_S,
    MAX_OFFENDERS,
    MAX_PULL_DONORS,
    AuditInfo,
    PullReport,
    PullStatus,
)
from chaos.trainer.policy_watch import PolicyWatch

__all__ = [
    "DaemonLink",
    "DaemonSession",
    "Policy",
    "StepBeacon",
    "TrainingStalled",
    "topology_epoch",
    "topology_of",
]

log = logging.getLogger("chaos.trainer")

_ATTEMPT_S = 5.0
"""How long one ``ready`` report waits for its answer."""
_RETRY_TOTAL_S = 15.0
"""A registration or ``ready`` report lost to a scheduler change is tried again within this long
in all (or the caller's own timeout, if longer): a failover takes a few seconds."""
_TRANSIENT = ("timeout", "paused", "not_scheduler", "unknown_peer", "overloaded")
"""Refusals that a scheduler change, or the local daemon joining again (``unknown_peer``: it
is not a member yet, e.g. a minority daemon after a partition heals), explains: the request
is tried again."""
_RETRY_BACKOFF_S = 0.2
"""Pause before a request refused at once for a transient reason is sent again."""
_BUSY_BACKOFF_S = 1.0
"""... and after an ``overloaded`` refusal: another joiner's entry takes seconds, not a
failover's moment, so asking five times a second only fills the scheduler's event log."""
_QUEUE_LOG_S = 10.0
"""A joiner waiting in line (``overloaded``) logs that it still waits this often."""
BEACON_INTERVAL_S = 0.2
"""The step progress goes to the daemon at most this often (and at least this often while the
trainer waits inside ``update()``); the daemon forwards the latest once per heartbeat."""


def transient(exc: ChaosError) -> bool:
    """Whether a request failed for a reason that a scheduler change or a partition explains
    (no answer, or refused ``timeout``, ``paused``, ``not_scheduler``, ``unknown_peer`` or
    ``overloaded``): the cluster can heal, and the request is worth sending again."""
    return isinstance(exc, ChaosTimeout) or getattr(exc, "reason", None) in _TRANSIENT


class TrainingStalled(ChaosTimeout):
    """A step could not be completed: no new policy came after a failure within the trainer's
    ``stall_timeout_s`` (never, when that is ``None``), or the daemon did not answer within
    ``policy_timeout_s``.

    It is a :class:`ChaosTimeout` (so a :class:`TimeoutError`): ``except ChaosTimeout`` catches
    it too.
    """


class DaemonLink(Protocol):
    """The requests a session makes to its daemon (a :class:`chaos.daemon.client.DaemonClient`)."""

    def policy(self, timeout_s: float | None = None) -> PolicyReply:
        """The policies in force at the daemon."""
        ...

    def register(self, reg: TrainerRegister, timeout_s: float | None = None) -> object:
        """Registers the trainer with the scheduler."""
        ...

    def trainer_event(self, event: AnsweredEvent, timeout_s: float | None = None) -> object:
        """Reports a trainer event to the scheduler (raises when it is not taken)."""
        ...

    def status(self, timeout_s: float | None = None) -> StatusReply:
        """The daemon's status."""
        ...

    def op(self, msg: AnsweredEvent, timeout_s: float | None = None) -> OpResult:
        """Sends a request to the daemon and returns its result."""
        ...

    def leave(
        self, timeout_s: float | None = None, gone: Callable[[], bool] | None = None
    ) -> object:
        """Makes the daemon leave the cluster."""
        ...

    def close(self) -> None:
        """Closes the connection."""
        ...


@dataclass(frozen=True)
class Policy:
    """The part of a daemon's :class:`~chaos.protocol.PolicyReply` a trainer acts on.

    Args:
        epoch: The policy's membership epoch.
        topo_epoch: The epoch of its data-plane structure (``SyncPolicyWire.topology_epoch``),
            which the allreduce frames carry; at most ``epoch``.
        members: The members taking part in the allreduce.
        topology: This node's allreduce topology; ``None`` when the node is not a member or the
            overlay is split.
        replication: The state replication policy for a joiner, if any.
        paused: The daemon holds training (no step may run under this policy).
        raw: The reply it was read from.
    """

    epoch: int
    topo_epoch: int
    members: tuple[str, ...]
    topology: Topology | None
    replication: ReplicationWire | None
    paused: bool
    raw: PolicyReply | None = field(repr=False, default=None)


class StepBeacon:
    """The trainer's step progress, told to its local daemon one way (never answered).

    The trainer notes when it enters and leaves ``update()``; while it is inside (waiting for
    the others, or reducing a large round), a background thread tells the daemon every
    :data:`BEACON_INTERVAL_S` that it is still alive. Each note goes out only when that interval
    has passed since the last one sent, so a fast loop costs the daemon a few messages a
    second; a note that the trainer left ``update()`` goes out at once when the daemon was last
    told it was inside (else the daemon would take a computing trainer for a waiting one). A
    trainer that computes for long, blocks in its script's own code, or whose process is
    stopped, is silent: that is what the scheduler looks for (docs/daemon.md, stragglers).

    Only an ``ipc://`` daemon endpoint (the local daemon) gets the notes; sends never block (a
    full queue drops the note: the next one says the same, newer).

    Args:
        endpoint: The daemon's endpoint.

    Raises:
        zmq.ZMQError: the endpoint cannot be connected to.
    """

    def __init__(self, endpoint: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()  # the socket and the state: the trainer and the thread
        self._step = 0
        self._in_step = False
        self._since = time.monotonic()  # when the trainer entered its phase
        self._sent_at = float("-inf")
        self._sent_in_step = False
        self._rate = 0.0  # samples per second of compute (0: not measured)
        self._global_batch = 0
        self._audit: AuditInfo | None = None
        self._pulling: PullStatus | None = None  # a joiner's pull, while it runs
        self._phase: TrainerPhase | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def note(self, step: int, in_step: bool) -> None:
        """The trainer is at ``step`` and entered (``in_step``) or left ``update()`` now."""
        now = time.monotonic()
        with self._lock:
            self._step, self._in_step, self._since = step, in_step, now
            if self._sent_in_step and not in_step:
                self._send(now)  # the daemon thinks it waits: say at once that it computes
            elif now - self._sent_at >= BEACON_INTERVAL_S:
                self._send(now)
        if in_step and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="chaos-step-beacon", daemon=True
            )  # fmt: skip
            self._thread.start()

    def throughput(self, samples_per_s: float, global_batch: int) -> None:
        """The trainer's throughput and global batch, sent with its next notes."""
        with self._lock:
            self._rate = max(0.0, min(samples_per_s, 1e12))
            self._global_batch = max(0, min(global_batch, 1 << 31))

    def audit(self, info: AuditInfo) -> None:
        """The trainer's state audit, sent with its next notes."""
        with self._lock:
            self._audit = info

    def phase(self, phase: TrainerPhase) -> None:
        """The trainer moved to ``phase``: said with its next report and every later one (not
        at once: its daemon forwards only the latest report at each heartbeat, and a report
        sent now could hide a pull's last one)."""
        with self._lock:
            self._phase = phase

    def nonfinite(self, step: int, devices: list[str]) -> None:
        """Tells the daemon at once (one way) that step ``step`` was skipped as non-finite,
        naming the devices whose gradients were bad (a full queue drops it: the scheduler
        counts a device when a majority of the members name it)."""
        msg = NonfiniteStep(step=step, devices=devices[:MAX_OFFENDERS])
        with self._lock:
            if self._closed.is_set():
                return
            try:
                self._sock.send(encode(msg), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("non-finite step report not sent: %s", exc)

    def pulling(self, done: int, total: int, per_donor: Mapping[str, int], last: bool) -> None:
        """A joiner's pull: ``done`` of ``total`` bytes, ``per_donor``; told at most every
        :data:`BEACON_INTERVAL_S`, and always when ``last`` (the pull ended). The reports
        after the pull say nothing of it again."""
        now = time.monotonic()
        donors = dict(sorted(per_donor.items())[:MAX_PULL_DONORS])
        with self._lock:
            self._pulling = PullStatus(pulled_bytes=done, total_bytes=total, donors=donors)
            if last or now - self._sent_at >= BEACON_INTERVAL_S:
                self._send(now)
            if last:
                self._pulling = None

    def alive(self) -> None:
        """The trainer is still in its phase (it waits inside ``update()``)."""
        now = time.monotonic()
        with self._lock:
            if now - self._sent_at >= BEACON_INTERVAL_S:
                self._send(now)

    def _run(self) -> None:
        """While the trainer is inside ``update()``, says it is alive every interval."""
        while not self._closed.wait(BEACON_INTERVAL_S / 2):
            if self._in_step:
                self.alive()

    def _send(self, now: float) -> None:
        """Sends the state (the lock held)."""
        if self._closed.is_set():
            return
        msg = TrainerProgress(
            step=self._step,
            in_step=self._in_step,
            elapsed_s=min(now - self._since, MAX_ELAPSED_S),
            samples_per_s=self._rate,
            global_batch=self._global_batch,
            audit=self._audit,
            pulling=self._pulling,
            phase=self._phase,
        )
        try:
            while self._sock.poll(0, zmq.POLLIN):  # a refusal from the daemon: nothing to do
                self._sock.recv_multipart(zmq.NOBLOCK)
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue (the daemon is busy) or a closed socket
            log.debug("step progress not sent: %s", exc)
            return
        self._sent_at = now
        self._sent_in_step = self._in_step
        self.sent += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Stops the thread (waiting at most ``timeout_s``) and closes the socket."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self._sock.close(linger=0)
        self._ctx.term()


def topology_epoch(reply: PolicyReply) -> int:
    """The epoch the allreduce frames of this policy carry (see ``topology_epoch``)."""
    sync = reply.sync
    return int(sync.topology_epoch) if sync is not None and sync.topology_epoch else reply.epoch


def topology_of(reply: PolicyReply, me: str) -> Topology | None:
    """Node ``me``'s allreduce topology under a policy.

    Args:
        reply: The daemon's policy.
        me: This node's id.

    Returns:
        The ring or tree of the sync policy; a ring of ``me`` alone for a single-node policy;
        ``None`` when ``me`` is not a member or the overlay is split (then the trainer waits for
        a policy that joins it up).
    """
    sync = reply.sync
    if sync is None or me not in sync.nodes or not sync.connected:
        return None  # not a member, or a split overlay: wait for a policy that joins it up
    addresses = dict(sync.addresses)
    epoch = topology_epoch(reply)
    # with a cluster key every trainer registered its key: frames are then accepted only from
    # the connection of the member they claim to come from
    keys = dict(sync.keys) if sync.keys and all(n in sync.keys for n in sync.nodes) else None
    if sync.kind == "ring" and sync.ring:
        return Topology("ring", tuple(sync.nodes), addresses, epoch, ring_order=tuple(sync.ring),
                        keys=keys)  # fmt: skip
    if sync.kind == "tree" and sync.parents:
        return Topology("tree", tuple(sync.nodes), addresses, epoch, parent=dict(sync.parents),
                        keys=keys)  # fmt: skip
    return Topology(
        "ring", (me,), {me: addresses.get(me, "tcp://127.0.0.1:1")}, epoch, ring_order=(me,)
    )


class DaemonSession:
    """A trainer's connection to its local daemon.

    Args:
        client: The connection to the daemon (closed by :meth:`close`).
        node_id: This node's id (the daemon's).
        poll_interval_s: Pause between two policy requests while waiting for a policy.
        policy_timeout_s: Longest silence of the daemon that a step boundary tolerates.
        policy_notices: Follow the daemon's policy notices (``False``: ask at every boundary).
        contact_since: ``time.monotonic()`` from which the daemon's silence is counted, until
            :meth:`poll` first hears from it.
        beacon: Where the trainer's step progress goes (``None``: nowhere; the scheduler then
            never takes this trainer for a straggler). Closed by :meth:`close`.
    """

    def __init__(
        self,
        client: DaemonLink,
        node_id: str,
        *,
        poll_interval_s: float,
        policy_timeout_s: float,
        policy_notices: bool,
        contact_since: float,
        beacon: StepBeacon | None = None,
    ) -> None:
        self.node_id = node_id
        self._beacon = beacon
        self._poll_interval_s = poll_interval_s
        self._policy_timeout_s = policy_timeout_s
        self._policy_notices = policy_notices
        self._last_contact = contact_since  # last answer from the local daemon
        self._watch: PolicyWatch | None = None
        self._fetched_epoch = -1  # the newest epoch a fetch returned (carried ones never older)
        self._client = client

    # ------------------------------------------------------------------ requests

    def register(
        self, reg: TrainerRegister, *, timeout_s: float, queue_s: float | None = 0.0
    ) -> None:
        """Registers the trainer's endpoints and state layout with the scheduler.

        Args:
            reg: The registration: the endpoints, whether the trainer holds a state, its
                tensor sizes, a restored state's digest, a catching-up join (the client adds
                this process's id and the data plane's key).
            timeout_s: Longest wait for one answer. A registration lost to a scheduler change
                (no answer, ``timeout``, ``paused``, ``not_scheduler``) is sent again, within
                ``max(timeout_s, _RETRY_TOTAL_S)`` in all.
            queue_s: Longest time it waits in line behind other joiners (refused
                ``overloaded``), not counted against ``timeout_s``; ``None``: no limit.

        Raises:
            ChaosTimeout: no answer in time.
            ProtocolError: refused or an unexpected answer.
        """
        self._retrying(
            "registration",
            lambda t: self._client.register(reg, timeout_s=t),
            timeout_s,
            queue_s=queue_s,
        )

    def report_ready(self, elapsed_s: float, detail: str, step: int) -> bool:
        """Tells the scheduler the trainer's state is in place (tried again, within
        ``_RETRY_TOTAL_S``, when a scheduler change loses it).

        Best effort: the trainer is in the policy already and trains on without it (the
        scheduler only measures the join with it, and ends the join's hold on the line when
        the hold expires instead). A report that finds no scheduler (an election, a partition)
        is logged, not raised.

        Returns:
            Whether the scheduler took the report.
        """
        try:
            self._retrying(
                "ready report",
                lambda t: self._client.trainer_event(
                    TrainerReady(elapsed_s=elapsed_s, detail=detail, step=step), timeout_s=t
                ),
                _ATTEMPT_S,
            )
        except (ChaosTimeout, ProtocolError) as exc:  # ProtocolError: refused as well
            log.warning("ready report not delivered (%s); training goes on", exc)
            return False
        return True

    def _retrying(
        self,
        what: str,
        attempt: Callable[[float], object],
        attempt_s: float,
        total_s: float | None = None,
        queue_s: float | None = 0.0,
    ) -> None:
        """Runs ``attempt(timeout_s)`` again after a failure that a scheduler change explains
        (no answer, ``timeout``, ``paused``, ``not_scheduler``, ``unknown_peer``) or a busy
        scheduler (``overloaded``: another joiner is catching up or entering), until it
        succeeds or ``max(attempt_s, total_s)`` has passed in all (``total_s`` ``None``:
        :data:`_RETRY_TOTAL_S`). Time spent refused ``overloaded`` (an attempt so refused and
        the pause after it: waiting in line) is not counted, up to ``queue_s`` in all
        (``None``: without limit).

        Raises:
            ChaosTimeout: the last attempt got no answer in time.
            ProtocolError: refused for another reason, or the last attempt was refused.
        """
        budget = max(attempt_s, _RETRY_TOTAL_S if total_s is None else total_s)
        start = time.monotonic()
        deadline = start + budget
        allowance = math.inf if queue_s is None else queue_s
        in_line = 0.0
        logged = start
        while True:
            tried = time.monotonic()
            try:
                attempt(min(attempt_s, max(deadline - tried, 0.1)))
                return
            except ChaosTimeout as exc:
                error: ChaosError = exc
            except ProtocolError as exc:
                reason = getattr(exc, "reason", None)
                if reason not in _TRANSIENT:
                    raise
                error = exc
                # refused at once (e.g. the daemon is joining again): back off, do not spin
                pause = _BUSY_BACKOFF_S if reason == "overloaded" else _RETRY_BACKOFF_S
                if reason == "overloaded" and in_line < allowance:
                    now = time.monotonic()
                    spent = min(now - tried + pause, allowance - in_line)
                    in_line += spent
                    deadline += spent  # time in line does not count against the budget
                    if now - logged >= _QUEUE_LOG_S:  # in line: say so now and then, not 1/s
                        logged = now
                        log.info("%s: waiting in line for %.0f s (%s)", what, in_line, exc)
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            if deadline - time.monotonic() < 0.5:
                raise error
            if getattr(error, "reason", None) != "overloaded":
                log.info("%s not answered (%s); trying again", what, error)

    def report_caught_up(
        self, step: int, lag: int, detail: str, timeout_s: float, queue_s: float | None = 0.0
    ) -> None:
        """Tells the scheduler this catching-up joiner is ready to enter the data plane
        (``caught_up``): it replayed up to ``step``, ``lag`` steps behind the donors' logs.

        Args:
            step: The step its state is at.
            lag: Steps behind the donors' logs.
            detail: Why it stopped replaying.
            timeout_s: How long it asks again in all while the scheduler is changing.
            queue_s: Longest time it waits in line behind another joiner's entry
                (``overloaded``), not counted against ``timeout_s``; ``None``: no limit.

        Raises:
            ChaosTimeout: no answer in time.
            ProtocolError: refused.
        """
        self._retrying(
            "catch-up report",
            lambda t: self._client.trainer_event(
                CaughtUp(detail=f"step {step}, {lag} behind: {detail}"[:200]), timeout_s=t
            ),
            _ATTEMPT_S,
            timeout_s,
            queue_s=queue_s,
        )

    def report_pull(self, report: PullReport | None) -> None:
        """Tells the scheduler what the joiner's pull executed (``replication_done``), from
        which it measures the per-shard cost; best effort, a lost report costs nothing else."""
        if report is None:
            return
        try:
            self._client.op(PullDone(pull=report), timeout_s=2.0)
        except ChaosError as exc:
            log.debug("replication report not taken: %s", exc)

    def report_step_failed(self, peer: str, epoch: int, waited_s: float = 0.0) -> str:
        """Tells the scheduler this node's step failed, so that a restart epoch comes even when
        nobody failed (e.g. a round that timed out); best effort.

        Args:
            peer: The peer the round named (the neighbour that stopped sending).
            epoch: The epoch the step ran under.
            waited_s: How long the round waited before it failed.

        Returns:
            The peer the scheduler blames: the member that stopped, when it knows one (the
            neighbour may only have stopped forwarding), else ``peer``; ``peer`` also when the
            report was not taken.
        """
        try:
            failed = StepFailed(
                detail=peer, epoch=epoch, elapsed_s=min(max(0.0, waited_s), MAX_ELAPSED_S)
            )
            result = self._client.trainer_event(failed, timeout_s=min(2.0, self._policy_timeout_s))
        except ChaosError as exc:
            log.debug("step_failed report not taken: %s", exc)
            return peer
        blamed = result.detail if isinstance(result, OpResult) else ""
        return blamed or peer

    # ------------------------------------------------------------------ step progress

    def step_started(self, step: int) -> None:
        """Tells the daemon (one way) that the trainer entered ``update()`` at ``step``."""
        if self._beacon is not None:
            self._beacon.note(step, in_step=True)

    def step_done(self, step: int) -> None:
        """Tells the daemon (one way) that the trainer left ``update()``, now at ``step``."""
        if self._beacon is not None:
            self._beacon.note(step, in_step=False)

    def report_throughput(self, samples_per_s: float, global_batch: int) -> None:
        """Adds the trainer's throughput (samples per second of compute) and its global batch
        to its step progress (one way), which the scheduler splits the global batch by; a
        trainer without a local ``ipc://`` daemon has no progress to add them to."""
        if self._beacon is not None:
            self._beacon.throughput(samples_per_s, global_batch)

    def report_nonfinite(self, step: int, devices: tuple[str, ...]) -> None:
        """Tells the daemon (one way) that step ``step`` was skipped as non-finite because of
        ``devices``; the scheduler evicts a repeat offender. Without a local ``ipc://`` daemon
        it goes nowhere."""
        if self._beacon is not None and devices:
            self._beacon.nonfinite(step, list(devices))

    def report_phase(self, phase: TrainerPhase) -> None:
        """Tells the daemon (one way, with the next step progress) the trainer's lifecycle
        phase, which its ``status`` shows, and the scheduler's for every member."""
        if self._beacon is not None:
            self._beacon.phase(phase)

    def report_audit(self, info: AuditInfo) -> None:
        """Adds the trainer's state audit to its step progress (one way), which its daemon
        shows in ``status``."""
        if self._beacon is not None:
            self._beacon.audit(info)

    @property
    def daemon_paused(self) -> bool:
        """Whether the daemon's last word was that it is paused (no majority heard): a
        partition, as far as this trainer can tell."""
        return self._watch is not None and self._watch.paused

    def pull_progress(self, done: int, total: int, per_donor: Mapping[str, int],
                      last: bool = False) -> None:  # fmt: skip
        """Tells the daemon (one way) how far this joiner's pull is: the scheduler shows it in
        ``status`` (see :meth:`StepBeacon.pulling`)."""
        if self._beacon is not None:
            self._beacon.pulling(done, total, per_donor, last)

    def still_waiting(self) -> None:
        """Tells the daemon (one way, at most every :data:`BEACON_INTERVAL_S`) that the trainer
        is alive, still waiting inside ``update()``."""
        if self._beacon is not None:
            self._beacon.alive()

    def neighbors(self) -> list[str]:
        """This node's overlay neighbours, as the daemon knows them."""
        st = self._client.status()
        mine = next((n for n in st.nodes if n.id == self.node_id), None)
        return sorted(mine.neighbors) if mine else []

    def leave(self, timeout_s: float, gone: Callable[[], bool] | None) -> None:
        """Makes the daemon leave the cluster (it exits afterwards).

        Raises:
            ChaosTimeout: no answer in time.
            DaemonGone: ``gone`` said the daemon exited first.
        """
        self._client.leave(timeout_s=timeout_s, gone=gone)

    # ------------------------------------------------------------------ policy

    def fetch(self, timeout_s: float = 5.0) -> Policy:
        """Asks the daemon for the policy in force (and starts following its notices).

        Raises:
            ChaosTimeout: no answer in time.
        """
        reply = self._client.policy(timeout_s=timeout_s)
        self._fetched_epoch = max(self._fetched_epoch, reply.epoch)
        if self._watch is None and reply.notify_address and self._policy_notices:
            self._watch = PolicyWatch(reply.notify_address)
            self._watch.heard(reply, time.monotonic())  # no asking at every step until a notice
        return self.policy_of(reply)

    def policy_of(self, reply: PolicyReply) -> Policy:
        """The :class:`Policy` of a daemon's reply, as this node sees it."""
        return Policy(
            epoch=reply.epoch,
            topo_epoch=topology_epoch(reply),
            members=tuple(reply.members if reply.sync is None else reply.sync.nodes),
            topology=topology_of(reply, self.node_id),
            replication=reply.replication,
            paused=reply.paused,
            raw=reply,
        )

    def wait(
        self,
        ok: Callable[[Policy], bool],
        timeout_s: float | None,
        what: str,
        *,
        stalled: bool = False,
        progress: Callable[[float, Policy | None], None] | None = None,
        progress_interval_s: float = 10.0,
    ) -> Policy:
        """Asks the daemon until it has an unpaused policy that satisfies ``ok``.

        Args:
            ok: The condition.
            timeout_s: Longest wait (``None``: as long as it takes).
            what: What is waited for (for the error message).
            stalled: The wait is a step's (after a failed or interrupted allreduce): its
                timeout is a :class:`TrainingStalled`.
            progress: Called with the seconds waited so far and the last policy seen, every
                ``progress_interval_s`` while the wait lasts (events and log lines).
            progress_interval_s: How often ``progress`` is called.

        Raises:
            TrainingStalled: ``stalled`` and no such policy after ``timeout_s``.
            ChaosTimeout: no such policy after ``timeout_s`` (outside a step).
        """
        start = time.monotonic()
        deadline = math.inf if timeout_s is None else start + timeout_s
        next_progress = start + progress_interval_s
        last: Policy | None = None
        answered = start  # the daemon's silence is bounded even when the wait is not
        error = TrainingStalled if stalled else ChaosTimeout
        while time.monotonic() < deadline:
            now = time.monotonic()
            if progress is not None and now >= next_progress:
                next_progress = now + progress_interval_s
                progress(now - start, last)
            if stalled:
                self.still_waiting()  # a step that waits is not a straggler
            try:
                last = self.fetch()
            except ChaosTimeout:
                if time.monotonic() - answered > self._policy_timeout_s:
                    raise error(f"the daemon did not answer for {self._policy_timeout_s} s "
                                f"while waiting for {what}") from None  # fmt: skip
                continue
            answered = time.monotonic()
            if ok(last) and not last.paused:
                return last
            time.sleep(self._poll_interval_s)
        raise error(f"timed out after {timeout_s} s waiting for {what}; last: {last}")

    def poll(self, installed_epoch: int) -> Policy | None:
        """The newer policy to install at this step boundary, if the daemon has one.

        The notices decide whether to ask; a notice that carried its policy saves the round
        trip. A daemon that is slow to answer (a busy or starved device) is not fatal: training
        goes on under the current policy, until the daemon has been silent for
        ``policy_timeout_s``.

        Args:
            installed_epoch: The epoch of the policy the trainer runs.

        Returns:
            A newer, unpaused policy that includes this node, or one that leaves it out
            (:meth:`excluded`: the scheduler evicted this trainer), or ``None``.

        Raises:
            TrainingStalled: no answer from the daemon for ``policy_timeout_s``.
        """
        if self._watch is not None:
            now = time.monotonic()
            if not self._watch.needs_fetch(installed_epoch, now):
                self._last_contact = now  # it heard from the daemon, nothing newer
                return None
            carried = self._watch.carried(max(installed_epoch, self._fetched_epoch - 1))
            if carried is not None:  # the notice brought the policy: no round trip
                self._last_contact = now
                p = self.policy_of(carried)
                if p.topology is not None:
                    return p
        try:
            p = self.fetch()
        except ChaosTimeout as exc:
            silent = time.monotonic() - self._last_contact
            if silent > self._policy_timeout_s:
                raise TrainingStalled(f"the daemon did not answer for {silent:.0f} s") from exc
            log.warning("daemon slow (%s); keeping the policy of epoch %d", exc, installed_epoch)
            return None
        self._last_contact = time.monotonic()
        if p.epoch > installed_epoch and (p.topology is not None or self.excluded(p)):
            return p if not p.paused else None
        return None

    def excluded(self, p: Policy) -> bool:
        """Whether an unpaused policy leaves this trainer out while its daemon is a member: the
        scheduler evicted it (a straggler), and it must join again, pulling the state."""
        raw = p.raw
        in_view = raw is None or self.node_id in raw.members
        return not p.paused and in_view and self.node_id not in p.members and bool(p.members)

    def restart_epoch(self, installed_epoch: int) -> int:
        """The structure epoch of a policy a notice announced as restarting the allreduce
        (``restart_allreduce``), newer than ``installed_epoch``; ``-1`` when there is none.

        Never blocks: the trainer calls it while waiting in an allreduce.
        """
        restart = self._watch.restart(installed_epoch) if self._watch is not None else None
        return topology_epoch(restart) if restart is not None else -1

    def evicted_epoch(self, installed_epoch: int) -> int:
        """The epoch of a policy a notice carried, newer than ``installed_epoch``, that leaves
        this trainer out (:meth:`excluded`); ``-1`` when there is none.

        Never blocks: the trainer calls it while waiting in an allreduce. A round this trainer
        waits in can then no longer complete: the scheduler evicted it (for a partition, say)
        and the others rerun the step without it.
        """
        if self._watch is None:
            return -1
        self._watch.needs_fetch(installed_epoch, time.monotonic())
        carried = self._watch.carried(installed_epoch)
        if carried is None:
            return -1
        p = self.policy_of(carried)
        return p.epoch if self.excluded(p) else -1

    def close(self) -> None:
        """Closes the daemon connection and the notice subscription (best effort)."""
        for part in (self._client, self._watch, self._beacon):
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - best effort on shutdown
                log.debug("close: %s", exc)
