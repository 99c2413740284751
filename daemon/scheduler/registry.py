"""The scheduler's record of the trainers registered with the daemons (data-plane membership).

The contract is docs/trainer-daemon-interface.md. :class:`TrainerRegistry` applies the scheduler
rules of the interface: it records registrations in the monitor, admits the first trainer with
its state, plans the state replication for a trainer without state (donors, measured links,
``chaos.scheduling.plan_replication``), refuses ``no_state_source`` and ``state_conflict``, turns
``ready`` into ``training``, and commits (or holds back) the allreduce restarts a failed step asks
for. Each member's side, which forwards its trainer's messages here, is
:class:`chaos.daemon.relay.TrainerRelay`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec
from chaos.daemon.context import Context
from chaos.daemon.scheduler.batch_split import BatchSplitter
from chaos.daemon.scheduler.monitor import ClusterMonitor, PullSample
from chaos.daemon.scheduler.planner import replication_policy
from chaos.daemon.scheduler.snapshot_lead import snapshot_step
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    AnsweredEvent,
    ApplyAt,
    CaughtUp,
    OpResult,
    PullDone,
    Reason,
    ReplicationWire,
    StepFailed,
    SyncPolicyWire,
    TrainerGone,
    TrainerInfo,
    TrainerProgress,
    TrainerReady,
    TrainerThroughput,
)
from chaos.protocol.ids import is_loopback_endpoint
from chaos.protocol.messages import PullReport, merge_ranges
from chaos.protocol.states import NodeState, TrainerState

ENTRY_EXCLUSIVE_S = 300.0
"""One joiner enters the data plane at a time: while one's entry (a commit that puts it into the
sync policy with a plan for its state) waits for its ``ready``, or while a catch-up joiner
pulls its snapshot and replays (from its registration to its ``caught_up``), another joiner's
registration (and during an entry, another's ``caught_up``) is refused ``overloaded`` and its
trainer asks again. A commit carries one plan, so
a later plan would replace the first joiner's in the commits that follow: donors that skip its
epoch never serve an entering joiner (the members wait in an allreduce for a joiner that waits
for them), and donors drop a catching-up joiner's snapshot and step log. An entry or catch-up
older than this no longer holds the others back (its joiner is stuck); for a catch-up it counts
from the joiner's report that its snapshot is pulled (from its registration until then). A
joiner the daemons see gone (its trainer's process exited, its node failed, left or was
evicted) holds nobody back at all."""
SNAPSHOT_CLOCK_AGE_S = 30.0
"""A donor's step clock counts for planning a snapshot while its last progress report is at
most this old (its step is extrapolated with its period; a busy device reports late). A donor
that reaches the planned step before the plan serves the next boundary's state instead."""


def _merged(assignment: dict[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
    """Per donor with work, its ranges merged (the form a joiner reports its pull in)."""
    return {nid: m for nid, ranges in assignment.items() if (m := merge_ranges(list(ranges)))}


class Commits(Protocol):
    """The epochs: the one committed last, the sync policy in force, the global batch's split
    it carries, and a new commit."""

    epoch: int
    last_sync: SyncPolicyWire | None
    batches: BatchSplitter

    def commit(  # noqa: D102
        self,
        cause: str,
        now: float,
        *,
        apply_at: ApplyAt = "after_allreduce",
        restart: bool = False,
        replication: ReplicationWire | None = None,
    ) -> object: ...


class Liveness(Protocol):
    """When each member was last heard."""

    last_heard: dict[str, float]


def loopback_advertised(node: str, endpoints: tuple[str, ...],
                        members: dict[str, str]) -> str | None:  # fmt: skip
    """Why a trainer's registration must be refused for advertising loopback, or ``None``.

    A trainer's data-plane endpoints on a loopback address reach only its own device; when a
    member's daemon (``node``'s own included) is at a non-loopback address, the members are on
    a network, and the others would connect to their own loopback: every pull from this
    trainer and every allreduce with it would fail, join after join.

    Args:
        node: The registering trainer's node.
        endpoints: Its advertised data-plane endpoints (``tcp://HOST:PORT``; empty ones are
            skipped).
        members: Active member -> its daemon's address.

    Returns:
        The refusal's detail (the endpoint, a member on the network, what to set), or
        ``None`` when nothing is advertised on loopback or every member is on loopback.
    """
    loop = [e for e in endpoints if e and is_loopback_endpoint(e)]
    if not loop:
        return None
    networked = sorted(m for m, a in members.items() if _on_network(a))
    if not networked:
        return None
    m = node if node in networked else networked[0]
    return (
        f"{node}'s trainer advertises its data plane at loopback {loop[0]} while member {m}'s "
        f"daemon is at {members[m]}: no other device could reach it; start the trainer with "
        "TrainerConfig host set to its device's address (or Trainer(listen=...) on it)"
    )


def _on_network(endpoint: str) -> bool:
    """Whether a daemon's ``tcp://HOST:PORT`` address names a host on a network (not
    loopback, not a wildcard); anything else says nothing."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return bool(host) and host not in ("0.0.0.0", "::", "*") and not is_loopback_endpoint(endpoint)


class TrainerRegistry:
    """The scheduler's record of the trainers (rules 1-5 of the interface).

    Args:
        ctx: The daemon's context (its id, its answers and its event log; the heartbeat and
            failure timeouts, the replication settings).
        monitor: The cluster monitor, where the trainers' states and endpoints are kept.
        commits: Commits the epochs a registration or a restart needs.
        liveness: When each member was last heard.
    """

    def __init__(
        self,
        ctx: Context[Any],
        monitor: ClusterMonitor,
        commits: Commits,
        liveness: Liveness,
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.monitor = monitor
        self.commits = commits
        self.liveness = liveness
        self.layout: list[int] | None = None
        self.state_digest = ""  # the first trainer's restored-state digest (stop-resume)
        self.registered_at: dict[str, float] = {}
        self.pending: dict[str, ReplicationWire] = {}
        # per joiner whose entry into the sync policy waits for its ready: when it was committed
        self.entering: dict[str, float] = {}
        # per catch-up joiner still replaying: its registration, or its snapshot pull's report
        self.replaying: dict[str, float] = {}
        # per blamed peer: the structure epoch of the last restart it caused, and when
        self.restarted: dict[str, tuple[int, float]] = {}
        # per blamed peer: a restart held back (when it is due, the failed epoch it answers)
        self.held: dict[str, tuple[float, int]] = {}
        # per blamed peer: restarts in a row whose rerun failed again on it (damps the next)
        self.repeats: dict[str, int] = {}

    # -- registration ----------------------------------------------------------------------

    def on_info(self, msg: TrainerInfo, reply: ReplyPath | None, now: float) -> None:
        """Applies a trainer registration (rules 1-3)."""
        mon, n = self.monitor, msg.node_id
        if not mon.has(n) or mon.state(n) != NodeState.ACTIVE:
            self._answer(reply, msg.op_id, Reason.BAD_REQUEST, f"{n} is not an active member")
            return
        members = {m: mon.address(m) for m in mon.members()}
        if (why := loopback_advertised(n, (msg.data_address, msg.shard_address), members)):
            self.ctx.event("trainer_refused", peer=n, reason="loopback_advertised", detail=why)
            self._answer(reply, msg.op_id, Reason.BAD_REQUEST, why)
            return
        cur = mon.trainer(n)
        training = [m for m in mon.trainer_members((TrainerState.TRAINING,)) if m != n]
        if msg.has_state:
            restored = bool(msg.state_digest) and msg.state_digest == self.state_digest
            if cur != TrainerState.TRAINING and training and not restored:
                self._answer(
                    reply,
                    msg.op_id,
                    Reason.STATE_CONFLICT,
                    f"{','.join(training)} already train: a second independent state cannot join",
                )
                return
            self._register_state(msg, cur, reply, now)
            return
        if self.layout is None or not training:
            why = "no trainer registered the state layout" if training else "no member trains"
            self._answer(reply, msg.op_id, Reason.NO_STATE_SOURCE, why)
            return
        if (busy := self._other_entry(n, now)) is not None:
            self._answer(reply, msg.op_id, Reason.OVERLOADED, busy)
            return
        repl = self._plan(n, now)
        if repl.skipped:
            self._answer(reply, msg.op_id, Reason.BAD_REQUEST, repl.skipped)
            return
        at_step = self._snapshot_step(repl, now) if msg.catch_up else None
        if at_step is not None:
            repl = msgspec.structs.replace(repl, at_step=at_step)
            mon.catching_up.add(n)
            self.replaying[n] = now
        else:
            mon.catching_up.discard(n)
            self.replaying.pop(n, None)
        mon.set_trainer(n, TrainerState.SYNCING, msg.data_address, msg.shard_address)
        mon.set_data_key(n, msg.data_key)
        self.registered_at[n] = now
        self.pending[n] = repl
        self.ctx.event(
            "replication_planned",
            peer=n,
            donors=sorted(repl.donor_addresses),
            multi_hop=not set(repl.donor_addresses) & set(mon.neighbors(n)),
            shard_size=repl.shard_size,
            makespan_s=repl.makespan_s,
            skipped=repl.skipped,
            per_shard_cost_s=repl.per_shard_cost_s,
            sync_s={d.id: d.sync_s for d in repl.donors},
            assignment=_merged(repl.assignment),
            at_step=at_step,
            catch_up_asked=msg.catch_up,
        )
        self._registered(n, "syncing", msg, reply)
        cause = "trainer_catch_up" if at_step is not None else "trainer_scale_out"
        if at_step is None:
            self.entering[n] = now
        self.commits.commit(cause, now, replication=repl)
        self._answer(reply, msg.op_id)

    def _other_entry(self, n: str, now: float, replays: bool = True) -> str | None:
        """Why ``n`` must wait: another joiner's entry in flight, or (``replays``) another
        joiner still catching up (:data:`ENTRY_EXCLUSIVE_S`)."""
        for m, since in self.entering.items():
            if m != n and self.monitor.has(m) and now - since < ENTRY_EXCLUSIVE_S:
                return f"{m} is entering the data plane; ask again once it is ready"
        if not replays:
            return None
        for m, since in sorted(self.replaying.items()):
            if m != n and self.monitor.has(m) and now - since < ENTRY_EXCLUSIVE_S:
                return f"{m} is catching up; ask again once it has entered"
        return None

    def _snapshot_step(self, repl: ReplicationWire, now: float) -> int | None:
        """The step a catch-up snapshot is planned at: the first boundary every donor reaches
        after the commit has reached it, from each donor's step clock, the measured latency of
        the scheduler's path to it and the plan's transfer time
        (:func:`~chaos.daemon.scheduler.snapshot_lead.snapshot_step`). ``None`` (a barrier
        join) while no donor's step period is measured."""
        age = SNAPSHOT_CLOCK_AGE_S
        steps = []
        for d in repl.donor_addresses:
            known = self.monitor.step_now(d, now, age)
            if known is None:
                continue
            left = self.monitor.tau_sync_s(d, now, age) or 0.0
            reach = 0.0  # the scheduler's own trainer: the commit is local
            if d != self.ctx.node_id:
                reach = self.monitor.path_link(self.ctx.node_id, d)[0] or 0.0
            steps.append(snapshot_step(known[0], known[1], left, reach, repl.makespan_s))
        return max(steps) if steps else None

    def _on_caught_up(self, n: str, now: float) -> None:
        """A catching-up joiner asks to enter: the sync policy takes it in (a new structure,
        applied after the members' current allreduce) with a plan for what still differs."""
        if n not in self.monitor.catching_up:
            return  # a retry, or a scheduler that never left it out (after an election)
        self.monitor.catching_up.discard(n)
        self.replaying.pop(n, None)
        repl = self._plan(n, now)
        self.pending[n] = repl
        self.entering[n] = now
        self.ctx.event("catch_up_entering", peer=n, donors=sorted(repl.donor_addresses))
        self.commits.commit("trainer_scale_out", now, replication=repl)

    def _register_state(
        self, msg: TrainerInfo, cur: TrainerState, reply: ReplyPath | None, now: float
    ) -> None:
        """The first trainer, or a training member's re-registration (new sizes or endpoints)."""
        mon, n = self.monitor, msg.node_id
        moved = (
            mon.node_attr(n, "data_address") != msg.data_address
            or mon.node_attr(n, "shard_address") != msg.shard_address
            or mon.node_attr(n, "data_key") != msg.data_key
        )
        mon.set_trainer(
            n, TrainerState.TRAINING, msg.data_address, msg.shard_address, msg.tensor_sizes
        )
        mon.set_data_key(n, msg.data_key)
        if msg.tensor_sizes is not None:
            self.layout = list(msg.tensor_sizes)
        others = [m for m in mon.trainer_members((TrainerState.TRAINING,)) if m != n]
        if not others:  # the first trainer: a restored cluster's members must match its state
            self.state_digest = msg.state_digest
        self.registered_at.pop(n, None)
        self.pending.pop(n, None)
        self.entering.pop(n, None)
        self.replaying.pop(n, None)
        self._registered(n, "training", msg, reply)
        if cur != TrainerState.TRAINING:
            self.commits.commit("trainer_registered", now)
        elif moved:  # a restarted trainer at new endpoints: the policy must name them
            self.commits.commit("trainer_moved", now)
        # a re-registration that changes only the sizes keeps the epoch
        self._answer(reply, msg.op_id)

    def _registered(self, n: str, state: str, msg: TrainerInfo, reply: ReplyPath | None) -> None:
        self.ctx.event(
            "trainer_registered",
            peer=n,
            trainer=state,
            has_state=msg.has_state,
            data_address=msg.data_address,
            shard_address=msg.shard_address,
            tensors=len(msg.tensor_sizes) if msg.tensor_sizes is not None else None,
            state_bytes=sum(self.layout) if self.layout else None,
        )

    def _plan(self, n: str, now: float) -> ReplicationWire:
        """Plans the replication to ``n`` from its training neighbours (else any trainer),
        with the monitor's measured inputs: each donor's tau_sync (the time left in the step
        it is in, from its progress reports; 0 when unknown), recorded on its link to ``n``,
        and the per-shard cost c fitted to earlier pulls (the configured prior before any)."""
        mon = self.monitor
        training = [m for m in mon.trainer_members((TrainerState.TRAINING,)) if m != n]
        if self.cfg.replication_strategy == "multi-source":
            donors = training  # every training member, multi-hop (Autoscaling)
        else:
            donors = [d for d in mon.neighbors(n) if d in training] or training
        links = {d: mon.path_link(d, n) for d in donors}
        max_age = 3 * self.cfg.heartbeat_interval_s  # a report counts this long (stragglers')
        sync_s = {d: mon.tau_sync_s(d, now, max_age) or 0.0 for d in donors}
        for d in donors:
            mon.set_tau_sync(d, n, sync_s[d])
        addresses = {d: a for d in donors if (a := mon.node_attr(d, "shard_address"))}
        c = mon.per_shard_cost_s
        return replication_policy(n, links, None, self.layout, self.cfg, addresses, sync_s, c)

    # -- measured inputs -------------------------------------------------------------------

    def on_progress(self, msg: TrainerProgress, now: float) -> None:
        """A training member's step progress: its step boundaries date tau_sync."""
        if self.monitor.trainer(msg.sender) == TrainerState.TRAINING:
            self.monitor.observe_progress(msg.sender, msg.step, msg.in_step, msg.elapsed_s, now)

    def _on_pull(self, n: str, pull: PullReport) -> None:
        """A joiner's executed pull: refits the per-shard cost c and logs
        ``replication_executed`` (the delivered assignment, and why it differs from the plan
        the scheduler issued, if it does)."""
        planned = self.pending.get(n)
        links = {d.id: d for d in planned.donors} if planned is not None else {}
        samples = []
        for d in pull.donors:
            if d.failed or d.shards <= 0 or not self.monitor.has(d.id):
                continue  # a dropped donor's part is partial
            link = links.get(d.id)
            if link is not None:
                prop, trans = link.prop_s, link.trans_s_per_byte
            else:
                lat, bw = self.monitor.path_link(d.id, n)
                prop, trans = lat or 0.0, 8.0 / (bw or self.cfg.default_bandwidth_bps)
            samples.append(PullSample(d.shards, d.elapsed_s, prop + d.bytes * trans))
        fit = self.monitor.observe_pull(samples)
        executed = {d.id: [(int(o), int(k)) for o, k in d.ranges] for d in pull.donors if d.ranges}
        same = planned is not None and executed == _merged(planned.assignment)
        self.ctx.event(
            "replication_executed",
            peer=n,
            as_planned=same and not pull.reason and not pull.replans,
            reason=pull.reason,
            replans=pull.replans,
            failed_donors={d.id: d.failed for d in pull.donors if d.failed},
            assignment=executed,
            per_shard_cost_fit_s=fit,
            per_shard_cost_s=self.monitor.per_shard_cost_s,
        )

    # -- events ----------------------------------------------------------------------------

    def on_throughput(self, msg: TrainerThroughput) -> None:
        """A training member's throughput (one-way, never answered): it goes to the global
        batch's split."""
        if self.monitor.trainer(msg.sender) == TrainerState.TRAINING:
            self.commits.batches.observe(msg.sender, msg.samples_per_s, msg.global_batch)

    def on_event(self, msg: AnsweredEvent, reply: ReplyPath | None, now: float) -> None:
        """Applies an answered trainer event (rule 4: :class:`TrainerReady` marks the node
        ``training``) and answers it."""
        n = msg.sender
        cur = self.monitor.trainer(n)
        elapsed_s = msg.elapsed_s if isinstance(msg, (TrainerReady, StepFailed)) else 0.0
        detail = "" if isinstance(msg, PullDone) else msg.detail
        self.ctx.event("trainer_event", peer=n, kind=msg.NAME, elapsed_s=elapsed_s,
                        detail=detail)  # fmt: skip
        if cur == TrainerState.NONE:
            self._answer(reply, msg.op_id, Reason.BAD_REQUEST, f"{n} has no registered trainer")
            return
        if isinstance(msg, StepFailed):
            self._on_step_failed(msg, reply, now)
            return
        if isinstance(msg, TrainerGone):
            self._on_gone(n, cur, now)
        elif isinstance(msg, PullDone):
            self._on_pull(n, msg.pull)
            if n in self.replaying:  # its snapshot is in: the replay's own time starts now
                self.replaying[n] = now
        elif isinstance(msg, CaughtUp) and cur == TrainerState.SYNCING:
            if (busy := self._other_entry(n, now, replays=False)) is not None:
                self._answer(reply, msg.op_id, Reason.OVERLOADED, busy)
                return
            self._on_caught_up(n, now)
        elif isinstance(msg, TrainerReady) and cur == TrainerState.SYNCING:
            self._on_ready(msg, now)
        self._answer(reply, msg.op_id)

    def _on_ready(self, msg: TrainerReady, now: float) -> None:
        """A syncing trainer holds the state: its node is ``training``, and the scale-out is
        logged with its delay (registration to ready) and donors."""
        mon, n = self.monitor, msg.sender
        mon.set_trainer(
            n,
            TrainerState.TRAINING,
            mon.node_attr(n, "data_address"),
            mon.node_attr(n, "shard_address"),
        )
        self.entering.pop(n, None)
        arrived = self.registered_at.pop(n, None)
        repl = self.pending.pop(n, None)
        donors = sorted(repl.donor_addresses) if repl is not None else []
        self.ctx.event(
            "scale_out_complete",
            peer=n,
            delay_s=now - arrived if arrived is not None else None,
            trainer_elapsed_s=msg.elapsed_s,
            donors=donors,
            multi_hop=bool(donors) and not set(donors) & set(mon.neighbors(n)),
        )

    def _on_gone(self, n: str, cur: TrainerState, now: float) -> None:
        """``n``'s daemon saw its trainer's process exit: ``n`` stays a member without a trainer,
        and the others rerun their step without it (a new structure, like a failure)."""
        mon = self.monitor
        mon.set_trainer(n, TrainerState.NONE, None, None)
        self.forget(n)
        self.ctx.event("trainer_gone", peer=n, was=cur.value)
        self.commits.commit("trainer_gone", now, apply_at="before_next_allreduce", restart=True)

    def _on_step_failed(self, msg: StepFailed, reply: ReplyPath | None, now: float) -> None:
        """A trainer's allreduce of epoch ``msg.epoch`` failed, blaming ``msg.detail``.

        The trainer waits for a newer policy before it reruns the step. When nothing else will
        bring one (no newer structure epoch yet, and the blamed peer is heard, so the failure
        detector will not remove it), the scheduler commits a restart: the same membership
        under a new epoch, applied before the next allreduce.

        Two cases hold the restart back (event ``restart_held``) instead; :meth:`tick` commits
        it when due if it is then still needed:

        - the blamed peer seems silent: held until the failure detector has had its turn
          (``failure_timeout_s`` and one heartbeat after the peer was last heard). A dead peer
          is removed by then, which brings the new epoch; a peer whose heartbeat was only late
          (a busy host) is heard again, and gets its restart;
        - the step failed again, blaming the same peer, in the epoch that peer's last restart
          made: held until ``failure_timeout_s`` after that restart. A peer killed a moment ago
          is still heard, and every rerun fails at once on it, so restarting at once would
          commit an epoch per failed rerun until the failure detector acts.

        The answer goes out after the decision, so a trainer (or a test) that has it sees the
        restart's commit already logged.
        """
        self._restart_or_hold(msg.detail, msg.epoch, now)
        # after the decision: an answer means it was taken; it names the peer blamed
        self._answer(reply, msg.op_id, detail=msg.detail)

    def _restart_or_hold(self, suspect: str, failed_epoch: int, now: float) -> None:
        if self._newer_structure(failed_epoch) or suspect in self.held:
            return
        due = self._restart_due(suspect, failed_epoch, now)
        if due <= now:
            self._restart(suspect, now, failed_epoch)
            return
        self.held[suspect] = (due, failed_epoch)
        self.ctx.event("restart_held", peer=suspect, epoch=failed_epoch, due_in_s=due - now)

    def _newer_structure(self, failed_epoch: int) -> bool:
        """Whether a data-plane structure newer than ``failed_epoch`` was issued (a commit that
        kept the structure, e.g. a link no tree uses, would not rerun the step: it does not
        count)."""
        last = self.commits.last_sync
        return (last.topology_epoch if last is not None else 0) > failed_epoch

    def _silent(self, peer: str, now: float) -> bool:
        """Whether ``peer`` is a member not heard for over 1.5 heartbeat intervals. The
        scheduler itself is always heard: it is the one answering."""
        if peer == self.ctx.node_id or not self.monitor.has(peer):
            return False
        heard = self.liveness.last_heard.get(peer, now)
        return now - heard > self.cfg.heartbeat_interval_s * 1.5

    def _restart_due(self, suspect: str, failed_epoch: int, now: float) -> float:
        """When a restart for a step of ``failed_epoch`` that blamed ``suspect`` may be
        committed (``now`` or earlier: at once)."""
        cfg = self.cfg
        due = now
        if self._silent(suspect, now):
            heard = self.liveness.last_heard.get(suspect, now)
            due = max(due, heard + cfg.failure_timeout_s + cfg.heartbeat_interval_s)
        last = self.restarted.get(suspect)
        if last is not None and failed_epoch >= last[0]:
            due = max(due, last[1] + self._repeat_hold_s(suspect))
        return due

    def _repeat_hold_s(self, suspect: str) -> float:
        """How long after its last restart a rerun that failed again on ``suspect`` is held:
        ``failure_timeout_s``, doubled for each restart in a row that failed again on it (at
        most 32 times), so that a peer whose trainer hangs does not cost an epoch every
        ``failure_timeout_s`` forever."""
        return self.cfg.failure_timeout_s * 2.0 ** min(self.repeats.get(suspect, 0), 5)

    def _restart(self, suspect: str, now: float, failed_epoch: int) -> None:
        self.held.pop(suspect, None)
        last = self.restarted.get(suspect)
        again = last is not None and failed_epoch >= last[0]
        if again and last is not None and now - last[1] < 4 * self._repeat_hold_s(suspect):
            self.repeats[suspect] = self.repeats.get(suspect, 0) + 1
        else:
            self.repeats.pop(suspect, None)
        self.commits.commit(
            "allreduce_restart", now, apply_at="before_next_allreduce", restart=True
        )
        self.restarted[suspect] = (self.commits.epoch, now)
        count = self.repeats.get(suspect, 0)
        if count:
            self.ctx.event(
                "restart_repeated",
                peer=suspect,
                restarts=count + 1,
                next_hold_s=self._repeat_hold_s(suspect),
            )

    def notes(self) -> list[str]:
        """Lines for ``status``: the replication planner's per-shard cost, and the peers whose
        restarts keep failing."""
        c, pulls = self.monitor.per_shard_cost_s, self.monitor.pulls_measured
        cost = (
            f"replication: per-shard cost c = {c:.3g} s, measured over {pulls} pulls"
            if c is not None
            else f"replication: per-shard cost c = {self.cfg.per_shard_cost_s:.3g} s "
            "(configured prior: no pull measured yet)"
        )
        return [cost] + [
            f"allreduce restarted {count + 1} times in a row, each rerun failing on {peer}; "
            f"the next restart is held {self._repeat_hold_s(peer):.1f} s"
            for peer, count in sorted(self.repeats.items())
            if count and self.monitor.has(peer)
        ]

    def tick(self, now: float) -> None:
        """Commits the held restarts that are due and still needed: no newer structure came,
        and the blamed peer is heard (a silent one is the failure detector's to remove); and
        a new split of the global batch when the throughputs drifted from the one installed
        (``batch_split``: the data plane stays as it is, no round is disturbed)."""
        last = self.commits.last_sync
        if last is not None and last.nodes and self.commits.batches.due(last.nodes, now):
            self.commits.commit("batch_split", now)
        for suspect, (due, failed_epoch) in list(self.held.items()):
            if now < due:
                continue
            self.held.pop(suspect)
            if not self._newer_structure(failed_epoch) and not self._silent(suspect, now):
                self._restart(suspect, now, failed_epoch)

    # -- bookkeeping -----------------------------------------------------------------------

    def carried(self) -> ReplicationWire | None:
        """The replication a commit carries while a joiner is still syncing (the latest one), so
        that a donor that skips an epoch still learns that it serves."""
        live = [r for n, r in self.pending.items() if self.monitor.has(n)]
        return live[-1] if live else None

    def forget(self, node: str) -> None:
        """Drops what is known about a node that left or failed."""
        self.commits.batches.forget(node)
        self.monitor.catching_up.discard(node)
        self.registered_at.pop(node, None)
        self.pending.pop(node, None)
        self.entering.pop(node, None)
        self.replaying.pop(node, None)
        self.restarted.pop(node, None)
        self.held.pop(node, None)
        self.repeats.pop(node, None)

    def absorb(self, node: str, fields: dict[str, Any]) -> bool:
        """Takes a member's trainer fields (those of its :class:`AgentReport`) after an election.

        Args:
            node: The member.
            fields: ``trainer``, ``data_address``, ``shard_address`` and ``tensor_sizes``.

        Returns:
            Whether the member's trainer state or endpoints changed (the sync policy may).
        """
        mon = self.monitor
        if not mon.has(node):
            return False
        if fields.get("trainer", "none") == "none":
            # an explicit "none": the member's trainer exited (its daemon watched it)
            if "trainer" not in fields or mon.trainer(node) == TrainerState.NONE:
                return False
            mon.set_trainer(node, TrainerState.NONE, None, None)
            self.forget(node)
            return True
        state = TrainerState(fields["trainer"])
        data = fields.get("data_address") or mon.node_attr(node, "data_address")
        shard = fields.get("shard_address") or mon.node_attr(node, "shard_address")
        sizes = fields.get("tensor_sizes")
        before = (mon.trainer(node), mon.node_attr(node, "data_address"),
                  mon.node_attr(node, "shard_address"))  # fmt: skip
        mon.set_trainer(node, state, data, shard, sizes)
        if state == TrainerState.TRAINING and sizes:
            self.layout = list(sizes)
        return before != (state, data, shard)

    def replan_syncing(self) -> None:
        """After an election: plans again for the syncing nodes whose plan was lost."""
        mon = self.monitor
        for n in mon.trainer_members((TrainerState.SYNCING,)):
            if n not in self.pending and self.layout is not None:
                repl = self._plan(n, time.monotonic())
                if not repl.skipped:
                    self.pending[n] = repl

    def _answer(
        self, reply: ReplyPath | None, op_id: str, reason: Reason | None = None, detail: str = ""
    ) -> None:
        if reason is not None:
            self.ctx.event("trainer_refused", reason=reason, detail=detail)
        self.ctx.out.respond(
            reply,
            OpResult(
                sender=self.ctx.node_id,
                epoch=self.commits.epoch,
                op_id=op_id,
                ok=reason is None,
                reason=reason,
                detail=detail,
            ),
        )
