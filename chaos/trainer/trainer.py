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
from typing import Any, NoReturn

import torch

from chaos import ops
from chaos.errors import (
    ChaosError,
    ChaosTimeout,
    ConfigError,
    DaemonGone,
    PeerFailure,
    ProtocolError,
    ReplicationError,
    RoundInterrupted,
)
from chaos.replication.steplog import LoggedStep
from chaos.security import Security
from chaos.trainer.catch_up import (
    CatchUpState,
    Hooks,
    StepSource,
    plans_snapshot,
    replay,
    run_logged_step,
)
from chaos.trainer.config import (
    TrainerConfig,
    check_endpoints,
    check_extra_state,
    check_num_samples,
    default_node_id,
)
from chaos.trainer.dataplane import DataPlane
from chaos.trainer.embedded import EmbeddedDaemon
from chaos.trainer.exit_signals import (  # capture_exit_event and request_exit are part of this API
    capture_exit_event as capture_exit_event,
)
from chaos.trainer.exit_signals import install_exit_handlers
from chaos.trainer.exit_signals import request_exit as request_exit
from chaos.trainer.gradients import GradientPacker
from chaos.trainer.join_retry import join_until
from chaos.trainer.session import DaemonSession, Policy, transient
from chaos.trainer.session import TrainingStalled as TrainingStalled  # part of this API
from chaos.trainer.throughput import ThroughputMeter
from chaos.trainer.wiring import connect_session, make_donor, open_data_plane, start_embedded

log = logging.getLogger("chaos.trainer")


class _Rejoined(Exception):
    """The scheduler had evicted this trainer (a straggler); it joined again inside
    ``update()``, pulling the current state, so the step's gradients are stale: the step is
    skipped (the next one computes them on the pulled state)."""


# ----------------------------------------------------------------------------- the trainer


class Trainer:
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
            self.config = TrainerConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Trainer option: {exc}") from exc
        check_endpoints(join, daemon, node_id, listen)
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
        self._embedded: EmbeddedDaemon | None = None
        t0 = time.monotonic()
        try:
            cfg, key = self.config, self._security
            address = daemon
            if address is None:
                self._embedded = start_embedded(self.node_id, cfg, join, listen)
                address = self._embedded.endpoint
            self._session = connect_session(address, self.node_id, cfg, key, t0)
            self._plane = open_data_plane(self.node_id, cfg, key, self._newer_policy)
            self._donor = make_donor(model, optimizer, self.node_id, self._plane, cfg, key,
                                     self._event, self.extra_state)  # fmt: skip
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
    def epoch(self) -> int:
        """The membership epoch of the policy in force."""
        return self._epoch

    @property
    def world_size(self) -> int:
        """Members taking part in the allreduce under the current policy."""
        return len(self._policy.members) if self._policy else 1

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
    def neighbors(self) -> list[str]:
        """This node's overlay neighbours, as the daemon knows them."""
        return self._session.neighbors()

    # ------------------------------------------------------------------ joining

    def _register_and_sync(self, joining: bool, t0: float, rejoin: bool = False) -> None:
        restored = self.config.restored and not rejoin
        if restored:
            joining = False
        session, plane = self._session, self._plane
        catch_up = joining and self.config.join_mode == "catch-up"
        session.register(
            plane.address,
            plane.shard_address,
            has_state=not joining,
            tensor_sizes=self._donor.initial_layout(has_state=not joining),
            timeout_s=self.config.join_timeout_s,
            state_digest=self._donor.restored_digest() if restored else "",
            catch_up=catch_up,
            queue_s=self.config.join_queue_timeout_s,
        )
        policy = session.wait(
            lambda p: (self.node_id in p.members and p.topology is not None)
            or (catch_up and plans_snapshot(p, self.node_id)),
            self.config.join_timeout_s,
            "the scheduler to add this trainer to the sync policy",
        )
        if catch_up and policy.topology is None:
            self._pull_snapshot(policy, t0)
            return
        if joining:
            self._step = self._donor.pull(policy.replication, policy.epoch)
            session.report_pull(self._donor.last_pull)  # the scheduler measures c from it
        self._install(policy)
        elapsed = time.monotonic() - t0
        # the throughput clock starts when the first update() returns: the time from here to the
        # first update() holds whatever the script does first (waiting for the world, loading
        # data), not a step's compute
        self._meter.stop()
        self._event("ready", elapsed_s=elapsed, epoch=self._epoch, step=self._step)
        session.report_ready(elapsed, f"epoch {self._epoch} step {self._step}")

    def _pull_snapshot(self, policy: Policy, t0: float) -> None:
        """A catching-up joiner pulls the donors' snapshot; the members train on. It enters the
        data plane in its first :meth:`update` (:meth:`_catch_up_and_enter`)."""
        rep = policy.replication
        if rep is None:
            raise ChaosError(f"the policy of epoch {policy.epoch} plans no snapshot")
        try:
            self._step = self._donor.pull(rep, policy.epoch)
        except (ReplicationError, ChaosTimeout) as exc:  # e.g. the donors are cut off for now
            self._event("snapshot_failed", epoch=policy.epoch, error=str(exc)[:300])
            log.warning("%s: no catch-up snapshot (%s); it enters pulling the whole state",
                        self.node_id, exc)  # fmt: skip
            self._catching = CatchUpState({}, policy.epoch, t0, self._step)
            return
        self._session.report_pull(self._donor.last_pull)
        self._catching = CatchUpState(dict(rep.donor_addresses), policy.epoch, t0, self._step)
        self._meter.stop()
        self._event("snapshot_pulled", epoch=policy.epoch, step=self._step,
                    planned_step=rep.at_step, elapsed_s=time.monotonic() - t0)  # fmt: skip

    def _catch_up_and_enter(self, hooks: Hooks) -> None:
        """Replays the steps the members took since the snapshot, asks the scheduler to enter
        (``caught_up``), and once the policy includes this trainer replays up to the step the
        donors serve and pulls only what still differs; then installs the policy (ready).

        Raises:
            ChaosTimeout: no policy with this trainer within ``join_timeout_s``, or the join
                again after a failed entry pull did not finish in time.
            ReplicationError: the join again could not pull the state from any neighbour.
            _Rejoined: the entry pull failed (the policy named no donor, the donors were gone)
                and this trainer joined again.
        """
        cu = self._catching
        if cu is None:
            return
        cfg, session = self.config, self._session
        source = StepSource(cu.donors, self._grads.zeros(), self._security)

        def apply(entry: LoggedStep) -> None:
            run_logged_step(entry, self._grads, self.optimizer, hooks)
            self._step += 1

        seen = [cu.epoch]

        def taken_in() -> bool:  # a new scheduler (after an election) made it a barrier join
            p = session.poll(seen[0])
            if p is not None:
                seen[0] = p.epoch
            return p is not None and self.node_id in p.members and p.topology is not None

        t0 = time.monotonic()
        first = replay(source, self._step, apply, until=None,
                       deadline=t0 + cfg.catch_up_timeout_s,
                       poll_interval_s=cfg.poll_interval_s, stop=taken_in)  # fmt: skip
        self._event("replayed", step=self._step, replayed=first.steps, lag=first.lag,
                    why=first.why, elapsed_s=time.monotonic() - t0)  # fmt: skip
        try:
            session.report_caught_up(self._step, first.lag, first.why, cfg.join_timeout_s,
                                     cfg.join_queue_timeout_s)  # fmt: skip
        except ProtocolError as exc:  # e.g. a new scheduler that never saw this registration
            self._enter_again(cu.epoch, exc)
        policy = session.wait(
            lambda p: self.node_id in p.members and p.topology is not None,
            cfg.join_timeout_s,
            "the scheduler to put this catching-up trainer into the sync policy",
        )
        tail: list[int] = []

        def to_snapshot(step: int) -> None:
            before = self._step
            last = replay(source, self._step, apply, until=step,
                          deadline=time.monotonic() + cfg.catch_up_timeout_s,
                          poll_interval_s=cfg.poll_interval_s)  # fmt: skip
            tail.extend((before, step, last.steps))

        try:
            self._step = self._donor.pull(policy.replication, policy.epoch, prepare=to_snapshot)
        except (ReplicationError, ChaosTimeout) as exc:  # e.g. a new scheduler named no donor
            self._enter_again(policy.epoch, exc)
        session.report_pull(self._donor.last_pull)
        self._catching = None
        self._install(policy)
        pull = self._donor.last_pull
        self._event("entered", epoch=self._epoch, step=self._step,
                    replayed=first.steps + (tail[2] if tail else 0),
                    pulled_bytes=sum(d.bytes for d in pull.donors) if pull else None,
                    state_bytes=pull.state_bytes if pull else None,
                    log_failures=source.failures)  # fmt: skip
        elapsed = time.monotonic() - cu.started
        self._event("ready", elapsed_s=elapsed, epoch=self._epoch, step=self._step)
        session.report_ready(elapsed, f"epoch {self._epoch} step {self._step} (caught up)")

    def _enter_again(self, epoch: int, exc: ChaosError) -> NoReturn:
        """A catching-up joiner's entry failed (event ``entry_failed``): it joins again.

        Raises:
            _Rejoined: always, once it joined again (it enters in a later ``update()``).
        """
        self._event("entry_failed", epoch=epoch, error=str(exc)[:300])
        log.warning("%s: entry failed (%s); joining again", self.node_id, exc)
        self._catching = None
        self._join_again()
        raise _Rejoined from exc

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

    def _refresh(self) -> bool:
        """Installs a newer policy at this step boundary, if the daemon has one; joins again
        if the newer policy leaves this trainer out (the scheduler evicted it as a straggler).

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
        if policy.topology is None:  # left out: evicted
            self._rejoin(policy)
            return True
        self._install(policy)
        return False

    def _rejoin(self, policy: Policy) -> None:
        """Joins again, as a joiner pulling the current state, after the scheduler evicted this
        trainer as a straggler (it was stopped, or blocked, while the others waited).

        Raises:
            ChaosTimeout: the join or the state pull did not finish in time.
            ReplicationError: the state could not be pulled from any neighbour.
        """
        self._event("evicted", epoch=policy.epoch, step=self._step)
        log.warning(
            "%s: left out of the sync policy of epoch %d (evicted as a straggler); joining again",
            self.node_id,
            policy.epoch,
        )
        self._join_again()

    def _join_again(self) -> None:
        """Registers again as a joiner and pulls the current state, until ``stall_timeout_s``
        has passed (``None``: for as long as it takes: a cluster that can heal is not given up
        on); see :meth:`_join_until`.

        Raises:
            ChaosTimeout: the last attempt's join or pull did not finish in time, and
                ``stall_timeout_s`` has passed.
            ProtocolError: the registration was refused for good, or refused
                ``no_state_source`` or for a transient reason when ``stall_timeout_s`` had
                passed.
            ReplicationError: the last attempt could not pull the state, and
                ``stall_timeout_s`` has passed.
        """
        self._donor.retire()
        limit = self.config.stall_timeout_s
        self._join_until(math.inf if limit is None else time.monotonic() + limit)

    def _join_until(self, deadline: float, t0: float | None = None) -> None:
        """Registers as a joiner and pulls the state, retrying a failed pull, a
        ``no_state_source`` refusal or a transient one (``paused``) until ``deadline``
        (monotonic; see :func:`join_until`). The
        first join passes ``t0`` (when the trainer started, for its ``ready`` time) and
        ``join_timeout_s`` after it; joining again passes neither.

        Raises:
            ChaosTimeout, ProtocolError, ReplicationError: as :func:`join_until`.
        """
        join_until(lambda: self._register_and_sync(True, time.monotonic() if t0 is None else t0,
                                                   rejoin=t0 is None),
                   deadline, self.node_id, self._event)  # fmt: skip

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
    ) -> None:
        """Averages the gradients over the members, then steps the optimizer.

        In this order: the allreduce writes the averaged gradients into every ``p.grad``;
        ``before_step()``; ``step_fn()`` (or ``optimizer.step()``); ``after_step()``; then
        :attr:`step` counts one more. Only the allreduce talks to other members: the hooks run
        on every member with the same averaged gradients, so what they compute is the same
        everywhere. A member that was evicted and joined again during the allreduce returns
        without calling any of them (it pulled the state the others reached).

        A failure or a membership change during the allreduce aborts it and reruns the step
        under the new policy; no partial result is ever applied.

        Args:
            num_samples: The samples this device's gradients come from in this step (over
                every backward pass since the gradients were zeroed). Each parameter's
                ``grad`` must then be the mean gradient over those samples (the gradient of
                the mean loss), and the average is weighted by sample: ``sum(N_i * g_i) /
                sum(N_i)`` over the members, the gradient of the mean loss over every sample
                of the cluster's step. ``None``: every member weighs the same (the mean of the
                members' gradients), as if each passed 1.
            before_step: Called with the averaged gradients, before the step: clip them
                (``torch.nn.utils.clip_grad_norm_``), or ``scaler.unscale_(optimizer)`` first.
            step_fn: Replaces ``optimizer.step()``, e.g. ``lambda: scaler.step(optimizer)``.
            after_step: Called after the step, before this step's state can be served to a
                joiner: advance everything in ``extra_state`` here (``scaler.update()``,
                ``scheduler.step()``, an EMA update).

        Raises:
            TypeError: ``num_samples`` is not an int.
            ValueError: ``num_samples`` is below 1.
            TrainingStalled: an allreduce failed (or was interrupted) and no new policy came
                within ``stall_timeout_s`` (``None``: it waits as long as it takes, reporting
                ``waiting`` events), or the daemon did not answer for ``policy_timeout_s``. It
                is a :class:`~chaos.errors.ChaosTimeout`.
        """
        check_num_samples(num_samples)
        session = self._session
        if self._catching is not None:
            # a catching-up joiner: its gradients were computed on the snapshot, steps ago;
            # it enters with weight 0 (the others' sample-weighted mean is the step's average)
            try:
                self._catch_up_and_enter((before_step, step_fn, after_step))
            except _Rejoined:  # its entry failed and it joined again: it enters next time
                self._meter.computing()
                return
            flat = self._grads.zeros()
        else:
            self._measure(num_samples)
            flat = self._grads.pack(num_samples)
        session.step_started(self._step)  # the step progress the scheduler finds stragglers by
        try:
            reduced = self._allreduce(flat)
        except _Rejoined:  # this trainer was evicted and joined again: its gradients are stale
            session.step_done(self._step)
            self._meter.computing()
            return
        if reduced is not None:
            self._grads.install(reduced)
        self._donor.retire()  # the state is about to change
        if self._donor.logging:  # a catching-up joiner replays this step from the log
            self._donor.log_step(self._step, reduced if reduced is not None else
                                 self._grads.pack(None))  # fmt: skip
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
        self._maybe_reregister()
        self._meter.computing()

    def _measure(self, num_samples: int | None) -> None:
        """Measures this step's throughput (see :mod:`chaos.trainer.throughput`); with a global
        batch, reports it to the daemon with the step progress."""
        samples = num_samples if num_samples is not None else self.local_batch_size
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
                out, caught_up = plane.allreduce(flat, self._step)
                if caught_up:
                    self._event("caught_up", epoch=self._epoch, step=self._step)
                return out
            except RoundInterrupted as exc:
                self._event("restart", epoch=self._epoch, step=self._step, reason=str(exc))
                target = plane.newer_round_seen() or plane.topology_epoch + 1

                def reached(p: Policy, target: int = target) -> bool:
                    return p.topo_epoch >= target and p.topology is not None

                self._stalled_epoch = plane.topology_epoch  # until a newer one is installed
                self._await_rerun(reached, f"the policy of epoch {target}")
            except PeerFailure as exc:
                self._on_failed_round(exc, time.monotonic() - started)
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
            paused = last is not None and last.paused
            self._event("waiting", what=what, waited_s=round(waited_s, 1), paused=paused,
                        epoch=self._epoch, step=self._step)  # fmt: skip

        cfg = self.config
        p = session.wait(wanted, cfg.stall_timeout_s, what, stalled=True,
                         progress=waiting, progress_interval_s=cfg.stall_progress_s)  # fmt: skip
        if p.topology is None:
            self._rejoin(p)
            raise _Rejoined
        self._install_newer(p)

    def _maybe_reregister(self) -> None:
        """Adam creates its state on the first step: tell the scheduler the new layout.

        A paused daemon (a minority side of a partition) or a scheduler change holds that up:
        it is sent again, with a ``waiting`` event about every 15 s, until ``stall_timeout_s``
        (``None``: for as long as it takes; a campaign trainer crashed on a 15 s limit).

        Raises:
            TrainingStalled: not taken within ``stall_timeout_s``.
            ProtocolError: refused for good.
        """
        sizes = self._donor.layout_change(self._step, self._epoch)
        if sizes is None:
            return
        plane, limit, started = self._plane, self.config.stall_timeout_s, time.monotonic()
        while True:
            try:
                self._session.register(plane.address, plane.shard_address, has_state=True,
                                       tensor_sizes=sizes, timeout_s=5.0)  # fmt: skip
                return
            except ChaosError as exc:
                waited = time.monotonic() - started
                if not transient(exc):
                    raise
                if limit is not None and waited >= limit:
                    raise TrainingStalled(f"the state's new layout not taken in {waited:.0f} s "
                                          f"({exc})") from exc  # fmt: skip
                self._event("waiting", what="the scheduler to take the state's new layout",
                            waited_s=round(waited, 1), paused=self._session.daemon_paused,
                            epoch=self._epoch, step=self._step)  # fmt: skip
                log.warning("%s: the state's new layout not taken yet (%s); still waiting",
                            self.node_id, exc)  # fmt: skip

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
        self._refresh()
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
        # a constructor that failed part way closes what it had opened, and only that
        for name in ("_plane", "_session"):  # each closes its own parts, best effort
            part: DataPlane | DaemonSession | None = getattr(self, name, None)
            if part is not None:
                part.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
