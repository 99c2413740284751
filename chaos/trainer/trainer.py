"""The Trainer API: a few lines that make a PyTorch script an elastic, self-healing cluster member.

Usage (paper Listings 1 and 2)::

    from chaos.trainer import Trainer, capture_exit_event

    trainer = Trainer(model, optimizer, join="tcp://HOST:PORT")   # or join=None: new cluster
    for x, y in loader:
        loss = loss_fn(model(x), y); loss.backward()
        trainer.update()                   # allreduce gradients, then optimizer step
        trainer.check_state_replication()  # serve my shards if the scheduler asked me to
        if capture_exit_event():
            trainer.request_node_exit()
            break

The trainer owns the data plane (see ``docs/trainer.md`` and
``docs/trainer-daemon-interface.md``): it allreduces gradients over the sync policy's topology,
serves state shards to joiners, and, when it joins, pulls the state from several neighbours at
once. The local daemon owns the control plane: it publishes a notice whenever its epoch changes
(:mod:`chaos.trainer.policy_watch`), and the trainer asks it for the policy at a step boundary
only when a notice names a newer epoch (or the notices fall silent), and, while it waits in an
allreduce, every ``poll_interval_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from chaos import ops
from chaos.errors import (
    ChaosError,
    ConfigError,
    DaemonGone,
    PeerFailure,
    RoundInterrupted,
)
from chaos.security import Security
from chaos.trainer.audit import StateAudit
from chaos.trainer.catch_up import CatchUpState, Hooks
from chaos.trainer.config import (
    TrainerConfig,
    check_endpoints,
    check_extra_state,
    check_num_samples,
    default_node_id,
    resolve_host,
)
from chaos.trainer.dataplane import DataPlane
from chaos.trainer.embedded import EmbeddedDaemon
from chaos.trainer.exit_signals import (  # capture_exit_event and request_exit are part of this API
    capture_exit_event as capture_exit_event,
)
from chaos.trainer.exit_signals import install_exit_handlers
from chaos.trainer.exit_signals import request_exit as request_exit
from chaos.trainer.finite import FiniteGuard, Verdict
from chaos.trainer.gradients import GradientPacker
from chaos.trainer.join_retry import UnreachableWatch
from chaos.trainer.joining import JoinFlows, _Rejoined
from chaos.trainer.lifecycle import Lifecycle, TrainerPhase
from chaos.trainer.session import DaemonSession, Policy
from chaos.trainer.session import TrainingStalled as TrainingStalled  # part of this API
from chaos.trainer.throughput import ThroughputMeter
from chaos.trainer.wiring import connect_session, make_donor, open_data_plane, start_embedded

log = logging.getLogger("chaos.trainer")


# ----------------------------------------------------------------------------- the trainer


class Trainer(JoinFlows):
    """Makes this training process a member of an elastic Chaos cluster.

    Args:
        model: The model; its parameters' gradients are averaged over the members each step.
        optimizer: Its optimizer; stepped by :meth:`update` after the allreduce.
        join: A member's daemon endpoint (``tcp://HOST:PORT``) to join through, or ``None`` to
            start a new cluster with this process's state.
        daemon: The local daemon's endpoint (``ipc://...``); ``None`` starts an embedded daemon.
        node_id: This node's id (default: ``HOSTNAME-PID``). With ``daemon=``, it must be that
            daemon's id.
        listen: The embedded daemon's control endpoint (default: a free port on ``host``).
        extra_state: More training state by name: any object with ``state_dict()`` and
            ``load_state_dict(state)`` (an LR scheduler, a ``torch.amp.GradScaler``, an EMA
            model, a sampler's position). It travels with the model and optimizer to a joiner
            and into :meth:`state_dict`, and stays bitwise equal on every member as long as the
            script changes it only inside :meth:`update` (its ``before_step``, ``step_fn`` or
            ``after_step``). Every member must name the same objects.
        **options: :class:`TrainerConfig` fields.

    Raises:
        ConfigError: bad options, or a malformed endpoint or node id (checked before anything
            starts), or an ``extra_state`` entry without ``state_dict``/``load_state_dict``.
        chaos.trainer.embedded.DaemonStartError: the embedded daemon could not start or join.
        ChaosTimeout: the join or the state pull did not finish in time.
        ReplicationError: the state could not be pulled from any neighbour.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        join: str | None = None,
        daemon: str | None = None,
        node_id: str | None = None,
        listen: str | None = None,
        extra_state: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        try:
            config = TrainerConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Trainer option: {exc}") from exc
        check_endpoints(join, daemon, node_id, listen)
        self.config = resolve_host(config, listen, join)  # the data plane's host
        self.extra_state: dict[str, Any] = check_extra_state(extra_state)
        self._security = Security.from_key_file(self.config.cluster_key)
        install_exit_handlers()
        # Build or load the native ops now: a first JIT build takes 30-60 s, which must not
        # happen inside a donor's serving thread or an allreduce with a timeout.
        ops.native_available()
        self.model = model
        self.optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._grads = GradientPacker(self._params)
        self.node_id = node_id if node_id is not None else default_node_id()
        self._finite = FiniteGuard(self.config.nonfinite, self.config.max_grad_norm,
                                   sum(p.numel() for p in self._params), self.node_id)  # fmt: skip
        self._step = 0
        self._epoch = -1
        self._round_started = 0.0  # when the allreduce in progress began (wait reports)
        self._stalled_epoch: int | None = None  # a failed round's structure epoch, until rerun
        self._next_wait_report = math.inf
        self._policy: Policy | None = None
        self._batch_sizes: dict[str, int] = {}  # the global batch's split in force
        self._meter = ThroughputMeter()  # samples per second of this member's compute
        self.events: list[dict[str, Any]] = []
        self._catching: CatchUpState | None = None  # a catching-up joiner, until it enters
        self._life = Lifecycle(self.node_id, self._on_phase)  # joining, ..., live, ..., closed
        self._unreachable = UnreachableWatch()  # joins failing on the same donor addresses
        self._embedded: EmbeddedDaemon | None = None
        t0 = time.monotonic()
        try:
            cfg, key = self.config, self._security
            address = daemon
            if address is None:
                self._embedded = start_embedded(self.node_id, cfg, join, listen)
                address = self._embedded.endpoint
            self._session = connect_session(address, self.node_id, cfg, key, t0)
            self._plane = open_data_plane(self.node_id, cfg, key, self._newer_policy, model)
            self._donor = make_donor(model, optimizer, self.node_id, self._plane, cfg, key,
                                     self._event, self.extra_state,
                                     self._session.pull_progress)  # fmt: skip
            self._audit = StateAudit(self.node_id, cfg.audit_every, self._donor.audit_digest)
            if join is not None and not cfg.restored:
                self._join_until(t0 + cfg.join_timeout_s, t0)
            else:
                self._register_and_sync(join is not None, t0)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ properties

    @property
    def step(self) -> int:
        """Optimizer steps taken by the cluster so far (equal on every member)."""
        return self._step

    @property
    def phase(self) -> TrainerPhase:
        """Where this trainer is in its lifecycle (:mod:`chaos.trainer.lifecycle`): joining,
        pulling, catching up, entering, live, stalled, paused, rejoining, leaving, closed."""
        return self._life.phase

    def _on_phase(self, old: TrainerPhase, new: TrainerPhase, why: str) -> None:
        """A lifecycle move: event ``phase``, and the daemon is told (its ``status``)."""
        self._event("phase", phase=new.value, previous=old.value, why=why, epoch=self._epoch,
                    step=self._step)  # fmt: skip
        session: DaemonSession | None = getattr(self, "_session", None)
        if session is not None:
            session.report_phase(new)

    @property
    def epoch(self) -> int:
        """The membership epoch of the policy in force."""
        return self._epoch

    @property
    def world_size(self) -> int:
        """Members taking part in the allreduce under the current policy."""
        return len(self._policy.members) if self._policy else 1

    @property
    def members(self) -> tuple[str, ...]:
        """The members taking part in the allreduce under the policy in force (empty before
        the first; a catching-up joiner is not among them until it enters)."""
        return tuple(self._policy.members) if self._policy else ()

    @property
    def data_links(self) -> int:
        """How many members this one exchanges allreduce frames with under the installed
        topology: its data-plane connections (0 alone, or before the first policy)."""
        topo = self._plane.topology
        return len(topo.neighbours(self.node_id)) if topo and self.node_id in topo.addresses else 0

    @property
    def local_batch_size(self) -> int | None:
        """This member's share of ``global_batch``: the samples to use in this step (pass it
        as ``update(num_samples=...)``). The scheduler splits the global batch in proportion
        to the members' measured throughput and installs the split with every membership
        change; until it has one, the members split it evenly. ``None`` without a
        ``global_batch``."""
        gb = self.config.global_batch
        if gb is None:
            return None
        mine = self._batch_sizes.get(self.node_id)
        if mine is not None:
            return mine
        members = sorted(self._policy.members) if self._policy else [self.node_id]
        if self.node_id not in members:
            return max(1, gb // max(1, len(members)))
        base, extra = divmod(gb, len(members))
        return max(1, base + (1 if members.index(self.node_id) < extra else 0))

    @property
    def batch_sizes(self) -> dict[str, int]:
        """The split of ``global_batch`` in force (member -> samples per step), as the
        scheduler installed it; empty before it has one, or without a ``global_batch``."""
        return dict(self._batch_sizes) if self.config.global_batch is not None else {}

    @property
    def samples_per_s(self) -> float | None:
        """This member's measured throughput: samples per second of compute between two
        ``update()`` calls (allreduce waits excluded), smoothed; ``None`` before two steps."""
        return self._meter.samples_per_s

    @property
    def nonfinite_offences(self) -> dict[str, int]:
        """Member id -> the steps its gradients were not finite (or over ``max_grad_norm``)
        and were skipped for it; the same on every member."""
        return dict(self._finite.offences)

    @property
    def neighbors(self) -> list[str]:
        """This node's overlay neighbours, as the daemon knows them."""
        return self._session.neighbors()

    # ------------------------------------------------------------------ joining

    def wait_world(self, size: int, timeout_s: float) -> None:
        """Blocks until the sync policy holds at least ``size`` members (stop-resume restarts).

        Raises:
            ChaosTimeout: fewer members after ``timeout_s``.
        """
        policy = self._session.wait(
            lambda p: len(p.members) >= size and p.topology is not None,
            timeout_s,
            f"{size} members",
        )
        if policy.epoch > self._epoch:
            self._install(policy)

    # ------------------------------------------------------------------ policy

    def _newer_policy(self) -> str | None:
        """Interrupt check run while blocked in an allreduce.

        The round is abandoned when a peer already runs this step under a newer epoch (then no
        member can complete it), or when the daemon announces a policy that restarts the
        allreduce under a new structure (``restart_allreduce``: a link found down, a failed
        step), or one that leaves this trainer out (evicted: the others rerun the step without
        it, and it joins again). Without the second, a link that drops its packets without
        closing the connection would hold every member in the round until ``step_timeout_s``.
        A newer policy alone does not abort it: a planned change applies after the current
        allreduce, and a member may already have completed this round (a member that aborts
        then gets that result, see :attr:`~chaos.collectives.frames.Op.RESULT`).
        """
        self._session.still_waiting()  # a trainer that waits is not the straggler
        now = time.monotonic()
        if now >= self._next_wait_report:  # a round that blocks long says so, as a step does
            self._next_wait_report = now + self.config.stall_progress_s
            if self._session.daemon_paused:
                self._life.move(TrainerPhase.PAUSED, "the daemon is paused (no majority)")
            self._event("waiting", what=f"the allreduce of step {self._step}",
                        waited_s=round(now - self._round_started, 1),
                        paused=self._session.daemon_paused, epoch=self._epoch,
                        step=self._step)  # fmt: skip
        plane = self._plane
        mine = plane.topology_epoch
        seen = plane.newer_round_seen()
        if seen is not None and seen > mine:
            return f"a peer runs step {self._step} under epoch {seen} (this node: {mine})"
        epoch = self._session.restart_epoch(self._epoch)
        if epoch > mine:
            plane.note_newer_round(epoch)
            return f"the daemon restarts the allreduce under epoch {epoch}"
        evicted = self._session.evicted_epoch(self._epoch)
        if evicted > self._epoch:  # the others rerun this step without this trainer
            return f"the policy of epoch {evicted} leaves this trainer out (evicted)"
        return None

    def _install(self, policy: Policy) -> None:
        """Installs a policy at a step boundary: sockets edited in place, donor role taken."""
        if policy.topology is None:
            raise ChaosError(f"the policy of epoch {policy.epoch} does not include {self.node_id}")
        self._plane.install(policy.topology)
        changed = self._policy is None or set(policy.members) != set(self._policy.members)
        self._policy = policy
        self._epoch = policy.epoch
        sync = policy.raw.sync if policy.raw is not None else None
        sizes = dict(sync.batch_sizes) if sync is not None else {}
        if sizes != self._batch_sizes and self.config.global_batch is not None:
            self._event("batch_split", epoch=policy.epoch, sizes=sizes)
        self._batch_sizes = sizes
        if changed:
            self._event("membership", epoch=policy.epoch, members=list(policy.members))
        self._donor.serve(policy.replication, policy.epoch, self._step)

    def _refresh(self, in_update: bool = True) -> bool:
        """Installs a newer policy at this step boundary, if the daemon has one; joins again
        if the newer policy leaves this trainer out (the scheduler evicted it as a straggler).

        Args:
            in_update: ``False`` from :meth:`check_state_replication`, before the loop set the
                next step's hyperparameters: a policy in which this donor serves a catching-up
                joiner's entry then waits for :meth:`update` (the entry pull carries the
                hyperparameters the joiner runs the entry step with).

        Returns:
            Whether this trainer joined again (its state is now the pulled one).

        Raises:
            TrainingStalled: no answer from the daemon for ``policy_timeout_s``.
        """
        if self._catching is not None:
            return False  # left out on purpose: it enters in its next update()
        policy = self._session.poll(self._epoch)
        if policy is None:
            return False
        if not in_update and self._donor.serves_entry(policy.replication):
            return False
        if policy.topology is None:  # left out: evicted
            self._rejoin(policy)
            return True
        self._install(policy)
        return False

    def _install_newer(self, p: Policy) -> None:
        """Installs the policy a wait after a failed round returned (the rerun needs exactly
        that structure or a later one, never an older one a notice may still carry)."""
        if p.epoch > self._epoch:
            self._install(p)

    # ------------------------------------------------------------------ training

    def update(
        self,
        num_samples: int | None = None,
        *,
        before_step: Callable[[], object] | None = None,
        step_fn: Callable[[], object] | None = None,
        after_step: Callable[[], object] | None = None,
    ) -> bool:
        """Averages the gradients over the members, then steps the optimizer.

        In this order: the allreduce writes the averaged gradients into every ``p.grad``;
        ``before_step()``; ``step_fn()`` (or ``optimizer.step()``); ``after_step()``; then
        :attr:`step` counts one more. Only the allreduce talks to other members: the hooks run
        on every member with the same averaged gradients, so what they compute is the same
        everywhere. A member that was evicted and joined again during the allreduce returns
        without calling any of them (it pulled the state the others reached).

        A failure or a membership change during the allreduce aborts it and reruns the step
        under the new policy; no partial result is ever applied.

        One call runs at most one live step, the one at the :attr:`step` the script read before
        the call, with the hyperparameters the script set for it. A call that joins (a
        catching-up joiner's entry, a join again after an eviction or a partition's heal)
        runs none: it returns with :attr:`step` at the cluster's step and the state, the
        hyperparameters included, as the members hold them; the loop's next call is the live
        step there. (A catching-up joiner takes part in its entry step with weight 0 and the
        members' hyperparameters, so that they need not wait for its gradients: its first
        live step is the next one.) So a loop may set the learning rate (or anything else)
        from :attr:`step` before each call (``docs/trainer.md``, *The step contract*).

        Args:
            num_samples: The samples this device's gradients come from in this step (over
                every backward pass since the gradients were zeroed). Each parameter's
                ``grad`` must then be the mean gradient over those samples (the gradient of
                the mean loss), and the average is weighted by sample: ``sum(N_i * g_i) /
                sum(N_i)`` over the members, the gradient of the mean loss over every sample
                of the cluster's step. ``None``: every member weighs the same (the mean of the
                members' gradients), as if each passed 1. ``0``: this member takes part in the
                step but contributes nothing (a joiner in local-steps mode); some member must
                contribute, or the step is not finite (see ``nonfinite``).
            before_step: Called with the averaged gradients, before the step: clip them
                (``torch.nn.utils.clip_grad_norm_``), or ``scaler.unscale_(optimizer)`` first.
            step_fn: Replaces ``optimizer.step()``, e.g. ``lambda: scaler.step(optimizer)``.
            after_step: Called after the step, before this step's state can be served to a
                joiner: advance everything in ``extra_state`` here (``scaler.update()``,
                ``scheduler.step()``, an EMA update).

        Returns:
            Whether this call ran a live step (``False``: it joined, and its gradients were
            not used; the state is the one the members hold at :attr:`step`).

        Raises:
            TypeError: ``num_samples`` is not an int.
            ValueError: ``num_samples`` is negative.
            TrainingStalled: an allreduce failed (or was interrupted) and no new policy came
                within ``stall_timeout_s`` (``None``: it waits as long as it takes, reporting
                ``waiting`` events), or the daemon did not answer for ``policy_timeout_s``. It
                is a :class:`~chaos.errors.ChaosTimeout`.
        """
        check_num_samples(num_samples)
        hooks = (before_step, step_fn, after_step)
        if self._catching is not None:
            # a catching-up joiner: its gradients were computed on the snapshot, steps ago, and
            # the script set its hyperparameters for the snapshot's step. It replays the logged
            # steps (with the members' hyperparameters), enters, and returns at the cluster's
            # step without a live step of its own: the loop's next call, with hyperparameters
            # set from the new trainer.step and gradients of the entered state, is its first
            # live step
            try:
                elapsed = self._catch_up_and_enter(hooks)
                if elapsed is not None:
                    entered_at = self._step
                    self._entry_step(hooks)
                    self._report_entry(elapsed, entered_at)
            except _Rejoined:  # its entry failed and it joined again: it enters next time
                pass
            self._meter.computing()
            return False
        self._measure(num_samples)
        return self._step_with(self._finite.outgoing(self._grads.pack(num_samples)), hooks)

    def _entry_step(self, hooks: Hooks) -> None:
        """A catching-up joiner that just entered takes part in the step it entered at with
        no gradient and weight 0, as a joiner in local-steps mode does, and applies the
        members' average with the hyperparameters it pulled with their state (theirs for
        this step) and this call's hooks, as it applies a logged step. So the members do not
        wait, at the entry step, for the joiner's gradients of the entered state: the joiner
        computes its first gradients beside them, for the next step."""
        if self.world_size > 1:
            self._step_with(self._grads.zeros(), hooks, entry=True)

    def _step_with(self, flat: torch.Tensor, hooks: Hooks, entry: bool = False) -> bool:
        """One live step with the packed gradients ``flat``: the allreduce, the verdict on
        the sum, the optimizer step with ``hooks`` (see :meth:`update`), the boundary's duties.

        Returns:
            Whether the step ran (``False``: this trainer was evicted and joined again, or it
            entered and found itself alone).

        Raises:
            _Rejoined: an entry step's trainer was evicted and joined again.
        """
        before_step, step_fn, after_step = hooks
        session = self._session
        session.step_started(self._step)  # the step progress the scheduler finds stragglers by
        try:
            reduced = self._allreduce(flat)
        except _Rejoined:  # this trainer was evicted and joined again: its gradients are stale
            session.step_done(self._step)
            self._meter.computing()
            if entry:  # that join reports its own ready: the entry's must not follow it
                raise
            return False
        if reduced is None and entry:  # alone now: nothing to apply, the next call steps
            return False
        members = self._policy.members if self._policy else ()
        bad = self._finite.verdict(flat if reduced is None else reduced, members)
        if bad is not None:  # every member holds the same sum: every member skips it alike
            self._nonfinite(bad)  # raises NonFiniteGradient in "raise" mode
            reduced = flat if reduced is None else reduced  # the step logged is the one skipped
        elif reduced is not None:
            self._grads.install(reduced)
        self._donor.retire()  # the state is about to change
        if self._donor.logging:  # a catching-up joiner replays this step from the log
            self._donor.log_step(self._step, reduced if reduced is not None else
                                 self._grads.pack(None))  # fmt: skip
        if bad is None:  # a skipped step runs no hook and no optimizer step, but counts
            if before_step is not None:
                before_step()
            if step_fn is not None:
                step_fn()
            else:
                self.optimizer.step()
            if after_step is not None:
                after_step()
        self._step += 1
        session.step_done(self._step)
        self._donor.at_boundary(self._step)  # a catch-up snapshot planned for this step
        if not entry:  # after the entry's ready report: the scheduler takes a layout only then
            self._maybe_reregister()
        self._audit_boundary()
        self._meter.computing()
        return True

    def _nonfinite(self, bad: Verdict) -> None:
        """A step whose summed gradients are not finite: event ``nonfinite_gradient`` naming
        the devices whose contribution was bad (see :mod:`chaos.trainer.finite`).

        Raises:
            NonFiniteGradient: ``TrainerConfig.nonfinite`` is ``"raise"``.
        """
        fields = self._finite.record(bad, self._step, self._epoch)
        self._event("nonfinite_gradient", **fields)
        self._session.report_nonfinite(self._step, self._finite.reported(bad))  # offenders
        log.warning("%s: the gradients of step %d are not finite (bad: %s; this device: %s); "
                    "%s", self.node_id, self._step, ", ".join(bad.devices) or "the sum",
                    self._finite.local_reason or "finite", fields["action"])  # fmt: skip
        self._finite.raise_if(bad, self._step)

    def _measure(self, num_samples: int | None) -> None:
        """Measures this step's throughput (see :mod:`chaos.trainer.throughput`); with a global
        batch, reports it to the daemon with the step progress."""
        samples = num_samples if num_samples is not None else self.local_batch_size
        if samples == 0:  # a member that contributes nothing computed nothing
            self._meter.stop()
            return
        rate = self._meter.measure(samples)
        gb = self.config.global_batch
        if rate is not None and gb is not None:
            self._session.report_throughput(rate, gb)

    def _allreduce(self, flat: torch.Tensor) -> torch.Tensor | None:
        plane = self._plane
        while True:
            if self._refresh():
                raise _Rejoined
            if self.world_size == 1:
                return None
            stalled = self._stalled_epoch
            if stalled is not None and plane.topology_epoch <= stalled:
                # the last update() gave up waiting (TrainingStalled) after a failed round of
                # this structure: the step reruns only under a newer one, so wait again first
                def newer(p: Policy, failed: int = stalled) -> bool:
                    return p.topo_epoch > failed and p.topology is not None

                self._await_rerun(newer, f"a new policy after the failed round of epoch {stalled}")
                continue
            self._stalled_epoch = None
            started = time.monotonic()
            self._round_started = started
            self._next_wait_report = started + self.config.stall_progress_s
            try:
                members = self._policy.members if self._policy else ()
                folded = self._audit.fold(flat, self._step, members)  # the state audit's digest
                # the sample count and the audit's tail travel exact in the int8 format; a
                # result kept under another membership has another audit tail (taken as none)
                audit_tail = folded.numel() - flat.numel()
                out, caught_up = plane.allreduce(folded, self._step, audit_tail + 1, audit_tail)
                if caught_up:
                    self._event("caught_up", epoch=self._epoch, step=self._step)
                self._life.move(TrainerPhase.LIVE, "a round completed")
                return self._audit.unfold(out)
            except RoundInterrupted as exc:
                self._event("restart", epoch=self._epoch, step=self._step, reason=str(exc))
                self._life.move(TrainerPhase.STALLED, "the round was interrupted")
                target = plane.newer_round_seen() or plane.topology_epoch + 1

                def reached(p: Policy, target: int = target) -> bool:
                    return p.topo_epoch >= target and p.topology is not None

                self._stalled_epoch = plane.topology_epoch  # until a newer one is installed
                self._await_rerun(reached, f"the policy of epoch {target}")
            except PeerFailure as exc:
                self._on_failed_round(exc, time.monotonic() - started)
                self._life.move(TrainerPhase.STALLED, "the round failed")
                failed = plane.topology_epoch  # the rerun needs a new structure epoch

                def renewed(p: Policy, failed: int = failed) -> bool:
                    return p.topo_epoch > failed and p.topology is not None

                self._stalled_epoch = failed  # until a newer structure is installed
                self._await_rerun(renewed, f"a new policy after {exc}")

    def _on_failed_round(self, exc: PeerFailure, waited_s: float) -> None:
        """Records a failed round (event ``allreduce_failed``) and reports it to the scheduler.

        The peer named is the member that stopped: the scheduler's answer names it when it
        knows one (the round's own peer, ``neighbour``, may only have stopped forwarding), and
        this node itself when the scheduler evicted it meanwhile (then it joins again).

        Raises:
            _Rejoined: this trainer had been evicted, and joined again.
        """
        session = self._session
        try:
            latest: Policy | None = session.fetch(timeout_s=min(2.0, self.config.policy_timeout_s))
        except ChaosError:
            latest = None
        fields = {"epoch": self._epoch, "step": self._step, "neighbour": exc.peer,
                  "error": str(exc)[:200]}  # fmt: skip
        if latest is not None and session.excluded(latest):
            self._event("allreduce_failed", peer=self.node_id, evicted=True, **fields)
            self._rejoin(latest)
            raise _Rejoined
        peer = session.report_step_failed(exc.peer, self._epoch, waited_s)
        self._event("allreduce_failed", peer=peer, **fields)

    def _await_rerun(self, ok: Callable[[Policy], bool], what: str) -> None:
        """Waits for the policy a step's rerun needs (``ok``) and installs it; joins again if a
        policy leaves this trainer out instead (evicted as a straggler meanwhile).

        Raises:
            TrainingStalled: no such policy within ``stall_timeout_s``.
            _Rejoined: this trainer had been evicted, and joined again.
        """
        session = self._session

        def wanted(p: Policy) -> bool:
            return ok(p) or session.excluded(p)

        def waiting(waited_s: float, last: Policy | None) -> None:
            paused = (last is not None and last.paused) or session.daemon_paused
            if paused:
                self._life.move(TrainerPhase.PAUSED, "the daemon is paused (no majority)")
            elif self._life.phase is TrainerPhase.PAUSED:
                self._life.move(TrainerPhase.STALLED, "the daemon is no longer paused")
            self._event("waiting", what=what, waited_s=round(waited_s, 1), paused=paused,
                        epoch=self._epoch, step=self._step)  # fmt: skip

        cfg = self.config
        p = session.wait(wanted, cfg.stall_timeout_s, what, stalled=True,
                         progress=waiting, progress_interval_s=cfg.stall_progress_s)  # fmt: skip
        if p.topology is None:
            self._rejoin(p)
            raise _Rejoined
        self._install_newer(p)

    def fail_at(self, step: int, after_frames: int = 0) -> None:
        """Fault injection by name: this device dies (``kill -9``) mid-allreduce of ``step``.

        Once this process has sent ``after_frames + 1`` data frames of that step's allreduce, its
        embedded daemon is killed with SIGKILL and the process exits at once, with no cleanup:
        the cluster sees a node failure in the middle of a collective. For tests and emulation.

        Raises:
            ValueError: a negative step or frame count.
        """
        embedded = self._embedded
        self._plane.fail_at(step, after_frames, embedded.kill if embedded is not None else None)

    def flip_bit_at(self, step: int, param: int = 0, element: int = 0, bit: int = 0) -> None:
        """Fault injection by name: flips one bit of one parameter on this member once its
        state reaches ``step`` (at the end of the ``update()`` that reaches it): bit ``bit`` of
        element ``element`` of the optimizer's ``param``-th parameter. A silent divergence,
        for the state audit (``audit_every``) to catch. For tests and emulation.

        Raises:
            ValueError: a negative step, index or bit.
        """
        self._audit.flip_bit_at(step, param, element, bit)

    def _audit_boundary(self) -> None:
        """At a step boundary: an armed bit flip; then, when the last audit found this
        member's state different from the others' (event ``state_diverged``), pulls the state
        again, only the chunks that differ (event ``state_healed``)."""
        audit = self._audit
        if audit.maybe_flip(self._step, self._params):
            self._event("bit_flipped", epoch=self._epoch, step=self._step)
        if (info := audit.info()) is not None:
            self._session.report_audit(info)  # chaos-daemon status shows it
        bad = audit.to_heal
        if bad is None:
            return
        audit.to_heal = None
        self._event("state_diverged", epoch=self._epoch, step=self._step, audit_step=bad.step,
                    first_step=audit.first_diverged, members=bad.members,
                    odd=list(bad.odd))  # fmt: skip
        log.error("%s: state differs from the other members' at the audit of step %d; "
                  "pulling it again", self.node_id, bad.step)  # fmt: skip
        cfg = self.config  # a barrier join: the members wait in the step this member is at, so
        self.config = replace(cfg, join_mode="barrier")  # its state differs only where it diverged
        try:
            self._join_again()
        finally:
            self.config = cfg
        audit.healed += 1
        pull = self._donor.last_pull
        self._event("state_healed", epoch=self._epoch, step=self._step, audit_step=bad.step,
                    pulled_bytes=sum(d.bytes for d in pull.donors) if pull else None,
                    state_bytes=pull.state_bytes if pull else None)  # fmt: skip

    @property
    def audit(self) -> dict[str, Any]:
        """The state audit's record on this member: ``every``, the ``last`` audited step and
        whether it ``agreed`` (``None`` before the first), and counts of ``audits``,
        ``mismatches`` (audits that found any member different) and ``healed`` (times this
        member pulled the state again)."""
        a = self._audit
        last = a.last
        return {"every": a.every, "last": last.step if last else None,
                "agreed": last.agreed if last else None, "audits": a.audits,
                "mismatches": a.mismatches, "healed": a.healed}  # fmt: skip

    def fail_serving_after(self, shards: int) -> None:
        """Fault injection by name: this device dies (``kill -9`` of its embedded daemon, then
        an abrupt exit) at the first shard request a joiner sends once ``shards`` more shards
        were served: a donor lost mid-pull. For tests and emulation.

        Raises:
            ValueError: a negative shard count.
        """
        embedded = self._embedded
        self._plane.die_serving_after(shards, embedded.kill if embedded is not None else None)

    def check_state_replication(self) -> bool:
        """Serves this node's shards if the scheduler named it a donor for a joiner.

        Call it right after :meth:`update` (a step boundary). The shards are sent from a
        background thread while the script computes the next step's gradients; the next
        :meth:`update` cannot finish before the joiner has them all.

        Returns:
            True when this node is serving a joiner now.
        """
        self._refresh(in_update=False)
        return self._donor.serving

    def request_node_exit(self, timeout_s: float = 15.0) -> None:
        """Leaves the cluster gracefully (scale-in), then releases every resource."""
        embedded = self._embedded
        try:
            self._session.leave(timeout_s, gone=embedded.exited if embedded else None)
            self._event("left", epoch=self._epoch, step=self._step)
        except DaemonGone as exc:  # the embedded daemon exited first (SIGHUP, or a failure)
            if embedded is not None and embedded.proc.returncode == 0:
                self._event("left", epoch=self._epoch, step=self._step)
            else:
                log.warning("leave request failed: %s", exc)
        except ChaosError as exc:
            log.warning("leave request failed: %s", exc)
        finally:
            if self._embedded is not None:
                self._embedded.wait_exit(timeout_s)
            self.close()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The full training state, for disk checkpoints (``torch.save``): model, optimizer,
        every ``extra_state`` object's state (under ``"extra"``), step, epoch, RNG."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
            "step": self._step,
            "epoch": self._epoch,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict` (same model and optimizer layout).

        Raises:
            KeyError: a required entry is missing.
        """
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name, extra in state.get("extra", {}).items():
            if name in self.extra_state:
                self.extra_state[name].load_state_dict(extra)
        self._step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])

    # ------------------------------------------------------------------ misc

    def _event(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "node": self.node_id, "event": kind, **fields}
        self.events.append(rec)
        log.info("%s %s", kind, fields)

    def iter_events(self) -> Iterator[dict[str, Any]]:
        """Membership and replication events seen so far, oldest first."""
        yield from self.events

    def close(self) -> None:
        """Closes the data plane and the daemon connection; stops an embedded daemon."""
        life: Lifecycle | None = getattr(self, "_life", None)
        if life is not None and life.phase is not TrainerPhase.CLOSED:
            life.move(TrainerPhase.LEAVING, "close()")
        # a constructor that failed part way closes what it had opened, and only that
        for name in ("_plane", "_session"):  # each closes its own parts, best effort
            part: DataPlane | DaemonSession | None = getattr(self, name, None)
            if part is not None:
                part.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        if life is not None and life.phase is TrainerPhase.LEAVING:
            life.move(TrainerPhase.CLOSED, "closed")

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
