"""How a trainer comes into the cluster's training, and back after it was left out.

:class:`JoinFlows` is the part of :class:`~chaos.trainer.Trainer` that joins: the first
registration and state pull (or a catching-up joiner's snapshot, replay and entry), a join
again after the scheduler evicted this trainer or a partition healed without it, and the
state layout's re-registration (Adam makes its state on the first step). The trainer's step
loop (:meth:`~chaos.trainer.Trainer.update`) calls into it; the shared state (``_step``,
``_epoch``, the session, the data plane, the donor) is the trainer's own.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from typing import Any, NoReturn

import torch

from chaos.errors import ChaosError, ChaosTimeout, ProtocolError, ReplicationError
from chaos.protocol import Reason, TrainerRegister
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
from chaos.trainer.config import TrainerConfig
from chaos.trainer.dataplane import DataPlane
from chaos.trainer.donor import Donor
from chaos.trainer.finite import FiniteGuard
from chaos.trainer.gradients import GradientPacker
from chaos.trainer.join_retry import UnreachableWatch, join_until
from chaos.trainer.lifecycle import Lifecycle, TrainerPhase
from chaos.trainer.session import DaemonSession, Policy, TrainingStalled, transient
from chaos.trainer.throughput import ThroughputMeter

log = logging.getLogger("chaos.trainer")


class _Rejoined(Exception):
    """The scheduler had evicted this trainer (a straggler); it joined again inside
    ``update()``, pulling the current state, so the step's gradients are stale: the step is
    skipped (the next one computes them on the pulled state)."""


class JoinFlows(abc.ABC):
    """The trainer's joins (see the module docstring); :class:`~chaos.trainer.Trainer` sets
    the attributes below and implements the two abstract methods."""

    config: TrainerConfig
    node_id: str
    optimizer: torch.optim.Optimizer
    _step: int
    _epoch: int
    _session: DaemonSession
    _plane: DataPlane
    _donor: Donor
    _catching: CatchUpState | None
    _unreachable: UnreachableWatch
    _meter: ThroughputMeter
    _grads: GradientPacker
    _security: Security
    _finite: FiniteGuard
    _life: Lifecycle

    @abc.abstractmethod
    def _event(self, kind: str, **fields: Any) -> None:
        """Records a trainer event."""

    @abc.abstractmethod
    def _install(self, policy: Policy) -> None:
        """Installs a sync policy."""

    def _register_and_sync(self, joining: bool, t0: float, rejoin: bool = False) -> None:
        restored = self.config.restored and not rejoin
        if restored:
            joining = False
        session, plane = self._session, self._plane
        catch_up = joining and self.config.join_mode == "catch-up"
        self._life.move(TrainerPhase.JOINING, "registering")
        reg = TrainerRegister(
            data_address=plane.address,
            shard_address=plane.shard_address,
            has_state=not joining,
            tensor_sizes=self._donor.initial_layout(has_state=not joining),
            state_digest=self._donor.restored_digest() if restored else "",
            catch_up=catch_up,
        )
        session.register(
            reg, timeout_s=self.config.join_timeout_s, queue_s=self.config.join_queue_timeout_s
        )
        policy = session.wait(
            lambda p: (self.node_id in p.members and p.topology is not None)
            or (catch_up and plans_snapshot(p, self.node_id)),
            self.config.join_timeout_s,
            "the scheduler to add this trainer to the sync policy",
        )
        if catch_up and policy.topology is None:
            self._life.move(TrainerPhase.PULLING, "pulling the donors' snapshot")
            self._pull_snapshot(policy, t0)
            self._life.move(TrainerPhase.CATCHING_UP, "it replays the logged steps next")
            return
        if joining:
            self._life.move(TrainerPhase.PULLING, "pulling the state")
            self._step = self._donor.pull(policy.replication, policy.epoch)
            session.report_pull(self._donor.last_pull)  # the scheduler measures c from it
        self._install(policy)
        elapsed = time.monotonic() - t0
        # the throughput clock starts when the first update() returns: the time from here to the
        # first update() holds whatever the script does first (waiting for the world, loading
        # data), not a step's compute
        self._meter.stop()
        self._unreachable.reset()
        self._event("ready", elapsed_s=elapsed, epoch=self._epoch, step=self._step)
        self._life.move(TrainerPhase.LIVE, "in the sync policy, with the state")
        session.report_ready(elapsed, f"epoch {self._epoch} step {self._step}", self._step)

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
            self._catching = CatchUpState({}, policy.epoch, t0, self._step, policy.members)
            return
        self._session.report_pull(self._donor.last_pull)
        self._catching = CatchUpState(dict(rep.donor_addresses), policy.epoch, t0, self._step,
                                      policy.members)  # fmt: skip
        self._meter.stop()
        self._event("snapshot_pulled", epoch=policy.epoch, step=self._step,
                    planned_step=rep.at_step, elapsed_s=time.monotonic() - t0)  # fmt: skip

    def _catch_up_and_enter(self, hooks: Hooks) -> float | None:
        """Replays the steps the members took since the snapshot, asks the scheduler to enter
        (``caught_up``), and once the policy includes this trainer replays up to the step the
        donors serve and pulls only what still differs; then installs the policy (event
        ``ready``; the caller reports it after the entry step, :meth:`_report_entry`).

        Returns:
            The seconds since the join began (``None``: not a catching-up joiner).

        Raises:
            ChaosTimeout: no policy with this trainer within ``join_timeout_s``, or the join
                again after a failed entry pull did not finish in time.
            ReplicationError: the join again could not pull the state from any neighbour.
            _Rejoined: the entry pull failed (the policy named no donor, the donors were gone)
                and this trainer joined again.
        """
        cu = self._catching
        if cu is None:
            return None
        cfg, session = self.config, self._session
        source = StepSource(cu.donors, self._grads.zeros(), self._security)

        def apply(entry: LoggedStep) -> None:
            skipped = self._finite.replayed(entry.grads, self._step, cu.epoch, cu.members)
            if skipped is None:
                run_logged_step(entry, self._grads, self.optimizer, hooks)
            else:  # the members skipped it: so does this one
                self._event("nonfinite_gradient", **skipped)
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
        self._life.move(TrainerPhase.ENTERING, "caught up: asked to enter")
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
        self._catching = None
        self._install(policy)
        self._life.move(TrainerPhase.LIVE, "entered: in the sync policy, with the state")
        pull = self._donor.last_pull
        self._event("entered", epoch=self._epoch, step=self._step,
                    replayed=first.steps + (tail[2] if tail else 0),
                    pulled_bytes=sum(d.bytes for d in pull.donors) if pull else None,
                    state_bytes=pull.state_bytes if pull else None,
                    log_failures=source.failures)  # fmt: skip
        elapsed = time.monotonic() - cu.started
        self._unreachable.reset()
        self._event("ready", elapsed_s=elapsed, epoch=self._epoch, step=self._step)
        return elapsed

    def _report_entry(self, elapsed_s: float, step: int) -> None:
        """Tells the scheduler, once the entry step is over, what the entry pull did and that
        this trainer is ready: two round trips through the daemon that the members would
        otherwise wait for in the entry step's allreduce."""
        session = self._session
        session.report_pull(self._donor.last_pull)
        session.report_ready(elapsed_s, f"epoch {self._epoch} step {step} (caught up)", step)

    def _enter_again(self, epoch: int, exc: ChaosError) -> NoReturn:
        """A catching-up joiner's entry failed (event ``entry_failed``): it joins again.

        Raises:
            _Rejoined: always, once it joined again (it enters in a later ``update()``).
            DonorAddressUnreachable: the same donor addresses refused connections entry
                after entry (they advertise an address this device cannot reach).
        """
        self._event("entry_failed", epoch=epoch, error=str(exc)[:300])
        self._unreachable.failed(exc, time.monotonic())
        log.warning("%s: entry failed (%s); joining again", self.node_id, exc)
        self._catching = None
        self._join_again()
        raise _Rejoined from exc

    def _rejoin(self, policy: Policy) -> None:
        """Joins again, as a joiner pulling the current state, after the scheduler evicted this
        trainer as a straggler (it was stopped, or blocked, while the others waited).

        Raises:
            ChaosTimeout: the join or the state pull did not finish in time.
            ReplicationError: the state could not be pulled from any neighbour.
        """
        self._event("evicted", epoch=policy.epoch, step=self._step)
        log.warning(
            "%s: left out of the sync policy of epoch %d (evicted: a straggler, or a repeat "
            "non-finite offender); joining again",
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
        self._life.move(TrainerPhase.REJOINING, "joining again")
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
                   deadline, self.node_id, self._event, self._unreachable)  # fmt: skip

    def _layout_refused(self, exc: ChaosError) -> None:
        """The scheduler no longer counts this trainer among the ones that train (it was
        evicted while its new layout waited, e.g. on the minority side of a partition, and its
        daemon joined again after the heal): its state is one the cluster moved on from, so it
        joins again and pulls the current one (event ``evicted``)."""
        self._event("evicted", epoch=self._epoch, step=self._step, reason=str(exc)[:200])
        log.warning("%s: the state's new layout was refused (%s): evicted meanwhile; joining "
                    "again", self.node_id, exc)  # fmt: skip
        self._join_again()

    def _maybe_reregister(self) -> None:
        """Adam creates its state on the first step: tell the scheduler the new layout.

        A paused daemon (a minority side of a partition) or a scheduler change holds that up:
        it is sent again, with a ``waiting`` event about every 15 s, until ``stall_timeout_s``
        (``None``: for as long as it takes; a campaign trainer crashed on a 15 s limit).

        Raises:
            TrainingStalled: not taken within ``stall_timeout_s``.
            ProtocolError: refused for good (a ``state_conflict`` refusal joins again instead:
                the scheduler evicted this trainer meanwhile).
        """
        sizes = self._donor.layout_change(self._step, self._epoch)
        if sizes is None:
            return
        plane, limit, started = self._plane, self.config.stall_timeout_s, time.monotonic()
        while True:
            try:
                reg = TrainerRegister(data_address=plane.address,
                                      shard_address=plane.shard_address, has_state=True,
                                      tensor_sizes=sizes)  # fmt: skip
                self._session.register(reg, timeout_s=5.0)
                return
            except ChaosError as exc:
                waited = time.monotonic() - started
                if getattr(exc, "reason", None) == Reason.STATE_CONFLICT.value:
                    self._layout_refused(exc)
                    return
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
