"""The trainer's training state as replication sees it: the donor's snapshots, the joiner's pull.

A :class:`Donor` captures the model's, optimizer's and extra objects' state: its tensor layout
(which the trainer registers with the scheduler, again when the optimizer creates its state), the
digest of a restored checkpoint, and the snapshot a donor serves to a joiner at a step boundary.
As a joiner it pulls the state from several donors at once and loads it into the model, the
optimizer and the extra objects.
It publishes its snapshots through a :class:`SnapshotServer` (the data plane's shard server).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from chaos.errors import ReplicationError
from chaos.protocol import ReplicationWire
from chaos.protocol.messages import MAX_PULL_RANGES, DonorPull, PullReport
from chaos.replication.donor_requests import gather_manifests
from chaos.replication.pull import PullConfig, PullStats, choose_plan, pull_state
from chaos.replication.state import (
    ExtraState,
    TrainingState,
    extra_digest,
    extra_tensor_count,
)
from chaos.replication.steplog import StepLog, encode_hypers
from chaos.scheduling import Neighbor, Plan
from chaos.scheduling.bounds import lower_bound
from chaos.security import Security
from chaos.trainer.pull_progress import Listener, PullProgress

__all__ = ["Donor", "EventSink", "SnapshotServer", "pull_report"]

log = logging.getLogger("chaos.trainer")


class SnapshotServer(Protocol):
    """Where a donor publishes the snapshot joiners pull (a shard server)."""

    def set_step_log(self, log: StepLog | None) -> None:
        """Serves ``log`` to a catching-up joiner (``None``: none)."""

    def publish(self, state: TrainingState, epoch: int, step: int) -> None:
        """Serves ``state`` as the snapshot of ``(epoch, step)``."""

    def also_serve(self, epoch: int, step: int) -> bool:
        """Serves the snapshot of ``step`` as the state of ``epoch`` too."""

    def retire(self) -> None:
        """Stops serving the snapshot."""


class EventSink(Protocol):
    """Records a trainer event (``kind`` and its fields)."""

    def __call__(self, kind: str, **fields: Any) -> None:
        """Records one event."""


def _step_width(step: int) -> int:
    """Bytes the step counter takes in the runtime record (msgpack grows it at 128, 256, ...)."""
    return len(msgspec.msgpack.encode(step))


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, as laid out in memory once contiguous (for digests)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Donor:
    """Captures, serves and pulls one trainer's training state.

    Args:
        model: The model.
        optimizer: Its optimizer.
        node_id: This node's id.
        snapshots: Where the served snapshots are published.
        event: Records the ``serving`` and ``replication_done`` events.
        join_timeout_s: Longest wait for the donors' manifests when joining.
        poll_interval_s: Pause between two manifest requests.
        replication_timeout_s: Limit on pulling the whole state.
        pull_window: Outstanding shard requests per donor.
        progress_interval_s: Seconds between two log lines of a pull (a bar on a terminal).
        pull_listener: Also told of a pull's progress (the daemon session).
        catch_up_log_bytes: Most gradient bytes a donor logs for a catching-up joiner.
        security: The cluster key the joiner's pulls connect with (default: none, plain).
        extra: Extra state objects by name (``state_dict()``/``load_state_dict()``) that travel
            with the training state.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        node_id: str,
        snapshots: SnapshotServer,
        event: EventSink,
        *,
        join_timeout_s: float,
        poll_interval_s: float,
        replication_timeout_s: float,
        pull_window: int,
        progress_interval_s: float = 5.0,
        pull_listener: Listener | None = None,
        catch_up_log_bytes: int = 1 << 30,
        security: Security | None = None,
        extra: ExtraState | None = None,
    ) -> None:
        self.model = model
        self.extra: ExtraState = dict(extra or {})
        self._security = security
        self.optimizer = optimizer
        self.node_id = node_id
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._snapshots = snapshots
        self._event = event
        self._join_timeout_s = join_timeout_s
        self._poll_interval_s = poll_interval_s
        self._replication_timeout_s = replication_timeout_s
        self._pull_window = pull_window
        self._progress_interval_s = progress_interval_s
        self._pull_listener = pull_listener
        self._layout: list[int] | None = None
        self._layout_width = _step_width(0)  # the step's encoded size when it was registered
        self.last_pull: PullReport | None = None
        """What the last pull executed (``None`` before one), for the scheduler."""
        self._published: tuple[int, int] | None = None
        self._frozen = False  # the published snapshot is a copy (a catch-up join's)
        self._log_bytes = catch_up_log_bytes
        self._catch_up: tuple[str, int, int] | None = None  # (joiner, snapshot step, epoch)
        self.step_log: StepLog | None = None
        """The log of the steps since a catch-up snapshot (``None``: no catch-up served)."""

    # ------------------------------------------------------------------ layout

    def initial_layout(self, has_state: bool) -> list[int] | None:
        """The tensor sizes the trainer registers with (``None`` for a joiner without state);
        remembered for :meth:`layout_change`. They are the sizes of the snapshot it would serve
        (its runtime record included), which the scheduler plans over."""
        sizes = self._capture_for_serving(0, 0).tensor_sizes() if has_state else None
        self._layout, self._layout_width = sizes, _step_width(0)
        return sizes

    def layout_change(self, step: int, epoch: int) -> list[int] | None:
        """The new tensor sizes if the layout changed since it was last registered, else
        ``None``: Adam creates its state on the first step, and the runtime record grows when
        the step counter's encoding does (steps 128, 256, 65536), so that the scheduler plans
        over the sizes of the snapshot the donors will serve."""
        sizes = None
        moved = _step_width(step) != self._layout_width
        if self._layout is None or moved or len(self._layout) != self._state_tensor_count():
            sizes = self._capture_for_serving(step, epoch).tensor_sizes()
            self._layout_width = _step_width(step)
        if sizes is not None and sizes != self._layout:
            self._layout = sizes
            return sizes
        return None

    def _state_tensor_count(self) -> int:
        n = len(self.model.state_dict())
        for st in self.optimizer.state.values():
            n += sum(1 for v in st.values() if isinstance(v, torch.Tensor))
        return n + extra_tensor_count(self.extra) + 1

    def restored_digest(self) -> str:
        """SHA-256 over the model's and optimizer's tensors and the extra objects' states (not
        the per-device RNG)."""
        h = hashlib.sha256()
        for name, t in self.model.state_dict().items():
            h.update(name.encode())
            h.update(_raw_bytes(t))
        for p in self._params:
            for key, v in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(key.encode())
                    h.update(_raw_bytes(v))
        if self.extra:
            h.update(extra_digest(self.extra).encode())
        return h.hexdigest()

    def audit_digest(self, step: int) -> bytes:
        """SHA-256 of the manifest of the state this member would serve at ``step``: its
        chunk addresses cover every tensor byte, and it names the hyperparameters, the
        optimizer's other values, the extra objects' state and the runtime record's digest
        (the online audit, :mod:`chaos.trainer.audit`). Equal states, equal digests."""
        return hashlib.sha256(self._capture_for_serving(step, 0).manifest_bytes).digest()

    # ------------------------------------------------------------------ serving

    @property
    def serving(self) -> bool:
        """A snapshot is published for a joiner now."""
        return self._published is not None

    def serve(self, replication: ReplicationWire | None, epoch: int, step: int) -> None:
        """Takes the donor role a policy gives this node, at a step boundary.

        A later epoch at the same step keeps the snapshot a joiner may be pulling, and serves
        it as that epoch's state too (a second joiner admitted before anyone stepped).

        Args:
            replication: The policy's replication part.
            epoch: The policy's epoch.
            step: The step the state is at.
        """
        rep = replication
        log_ = self.step_log
        if log_ is not None and (rep is None or rep.target != log_.target):
            self._end_catch_up()  # the joiner entered (or is gone): its log is done
        elif log_ is not None and rep is not None and rep.at_step is None:
            log_.close(step)  # the joiner enters the data plane at this step
        if rep is None or rep.target == self.node_id or self.node_id not in rep.donor_addresses:
            return
        if rep.at_step is not None:
            cu = self._catch_up
            if cu is None or cu[:2] != (rep.target, rep.at_step):
                self._end_catch_up()  # a new plan (the joiner registered again): start over
                self._catch_up = (rep.target, rep.at_step, epoch)
            elif self._frozen and self._published is not None:
                # a later commit carries the same plan: its epoch names the same snapshot
                self._snapshots.also_serve(epoch, self._published[1])
            self.at_boundary(step)
            return
        self._catch_up = None
        key = (epoch, step)
        if self._published is None or self._published[1] != step or self._frozen:
            self._snapshots.publish(self._capture_for_serving(step, epoch), *key)
            self._published, self._frozen = key, False
            self._event("serving", joiner=rep.target, epoch=epoch, step=step)
        elif epoch != self._published[0] and self._snapshots.also_serve(epoch, step):
            self._event("serving", joiner=rep.target, epoch=epoch, step=step, same_snapshot=True)

    def serves_entry(self, replication: ReplicationWire | None) -> bool:
        """Whether ``replication`` names this donor to serve the entry of the catching-up
        joiner it logs steps for (the joiner enters the data plane at the next step)."""
        log_, rep = self.step_log, replication
        return (log_ is not None and rep is not None and rep.at_step is None
                and rep.target == log_.target and self.node_id in rep.donor_addresses)  # fmt: skip

    def retire(self) -> None:
        """Stops serving the published snapshot, if any (the state is about to change); a
        catch-up snapshot (a copy) stays, and a closed step log is dropped (its joiner has
        entered)."""
        if self.step_log is not None and self.step_log.closed_at is not None:
            self._end_catch_up()
        if self._published is not None and not self._frozen:
            self._snapshots.retire()
            self._published = None

    # ------------------------------------------------------------------ catch-up joins

    def at_boundary(self, step: int) -> None:
        """At a step boundary (``step``: the state's step): publishes the catch-up snapshot
        once the state reaches the planned step, and starts its step log. A donor that
        installed the plan late snapshots the step it is at (the joiner pulls from the donors
        that serve the step the first one to answer serves)."""
        cu = self._catch_up
        if cu is None or self.step_log is not None or step < cu[1]:
            return
        joiner, at, epoch = cu
        if self._published is not None and not self._frozen:
            self._snapshots.retire()
        state = self._capture_for_serving(step, epoch)
        state.freeze()
        self._snapshots.publish(state, epoch, step)
        self._published, self._frozen = (epoch, step), True
        self.step_log = StepLog(joiner, step, self._log_bytes)
        self._snapshots.set_step_log(self.step_log)
        self._event("serving", joiner=joiner, epoch=epoch, step=step, catch_up=True,
                    planned_step=at)  # fmt: skip

    @property
    def logging(self) -> bool:
        """A step log for a catching-up joiner is growing (call :meth:`log_step`)."""
        log_ = self.step_log
        return log_ is not None and log_.closed_at is None and not log_.stopped

    def log_step(self, step: int, grads: torch.Tensor) -> None:
        """Logs step ``step`` for a catching-up joiner: ``grads``, the gradient buffer this
        member installed (weight last), and the hyperparameters now (call it right before the
        optimizer step)."""
        log_ = self.step_log
        if log_ is None or log_.closed_at is not None or log_.stopped:
            return
        if not log_.append(step, grads, encode_hypers(self.optimizer)):
            self._event("catch_up_log_stopped", joiner=log_.target, step=step,
                        reason=log_.stopped, bytes=log_.nbytes)  # fmt: skip

    def _end_catch_up(self) -> None:
        """Drops the step log and the catch-up snapshot."""
        self._catch_up = None
        if self.step_log is not None:
            self.step_log = None
            self._snapshots.set_step_log(None)
        if self._frozen:
            self._snapshots.retire()
            self._published, self._frozen = None, False

    def _capture_for_serving(self, step: int, epoch: int) -> TrainingState:
        """The state a donor serves. Every donor must serve the same bytes, but each device's
        RNG stream is its own; so the RNG states handed to a joiner are a cluster-wide seed
        derived from the step, and this device's own RNG states are restored afterwards."""
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        try:
            seed = 0x9E3779B97F4A7C15 ^ step
            torch.manual_seed(seed & 0xFFFFFFFF)
            random.seed(seed)
            np.random.seed(seed & 0xFFFFFFFF)
            return TrainingState.capture(
                self.model, self.optimizer, step=step, epoch=0, extra=self.extra
            )
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    # ------------------------------------------------------------------ joining

    def pull(
        self,
        replication: ReplicationWire | None,
        epoch: int,
        prepare: Callable[[int], None] | None = None,
    ) -> int:
        """Pulls the state from the donors a policy names and loads it (the joiner's side).

        Only the chunks this trainer does not hold already are pulled (content addressing).

        Args:
            replication: The policy's replication part.
            epoch: The policy's epoch.
            prepare: Called with the step of the donors' snapshot before this trainer's state
                is compared with it (a catching-up joiner replays up to that step there).

        Returns:
            The step of the state pulled.

        Raises:
            ReplicationError: the policy names no donor for this node, or no donor could serve.
            ChaosTimeout: the pull did not finish in time.
        """
        rep = replication
        if rep is None or rep.target != self.node_id or not rep.donor_addresses:
            raise ReplicationError(
                f"the policy of epoch {epoch} names no donor for {self.node_id}: "
                f"{getattr(rep, 'skipped', '') or 'no replication policy'}"
            )
        t0 = time.monotonic()
        manifest, keys = gather_manifests(
            dict(rep.donor_addresses),
            epoch,
            self._join_timeout_s,
            self._poll_interval_s,
            security=self._security,
        )
        t_manifest = time.monotonic()
        step = next(iter(keys.values()))[1]
        if prepare is not None:
            prepare(step)
        state = TrainingState.for_joiner(self.model, self.optimizer, manifest, self.extra)
        # every donor that answered has published: its allreduce round is over (tau_sync 0)
        neighbors = [Neighbor(d.id, d.prop_s, d.trans_s_per_byte, 0.0) for d in rep.donors
                     if d.id in keys]  # fmt: skip
        plan, reason = choose_plan(state, rep, neighbors)
        progress = PullProgress(self.node_id, self._progress_interval_s,
                                listener=self._pull_listener)  # fmt: skip
        try:
            stats = pull_state(
                plan,
                {d: a for d, a in rep.donor_addresses.items() if d in keys},
                state,
                {d: e for d, (e, _) in keys.items()},
                step,
                self._replication_timeout_s,
                neighbors=neighbors,
                config=PullConfig(window=self._pull_window),
                security=self._security,
                on_progress=progress,
            )
        finally:
            progress.close()
        t_pulled = time.monotonic()
        runtime = state.apply()
        self.last_pull = pull_report(stats, plan, reason, state.total_bytes)
        self._event(
            "replication_executed",
            reason=reason,
            as_planned=not reason and not stats.replans,
            per_shard_cost_s=plan.per_shard_cost_s,
            assignment={k: v for k, v in stats.ranges_per_donor.items() if v},
            failed_donors=dict(stats.failed_donors),
        )
        self._event(
            "replication_done",
            elapsed_s=time.monotonic() - t0,
            wait_donors_s=t_manifest - t0,
            transfer_s=t_pulled - t_manifest,
            planned_s=plan.makespan_s,
            lower_bound_s=lower_bound(state.total_bytes, neighbors),
            bytes=state.total_bytes,
            reused_bytes=state.reused_bytes,  # chunks this joiner held already
            pulled_bytes=sum(stats.bytes_per_donor.values()),
            donors=stats.bytes_per_donor,
            donor_elapsed_s=dict(stats.elapsed_per_donor),
            replans=stats.replans,
            checksum_failures=stats.checksum_failures,
        )
        return runtime.step


def pull_report(stats: PullStats, plan: Plan, reason: str, state_bytes: int) -> PullReport:
    """The scheduler's account of a pull: per donor its bytes, shards, transfer time, the
    ranges it delivered (left out past :data:`MAX_PULL_RANGES`) and why it was dropped.

    Args:
        stats: What the pull did.
        plan: The plan it started with.
        reason: Why that plan differs from the scheduler's (``""``: it does not).
        state_bytes: The state's size.

    Returns:
        The report the joiner sends with ``replication_done``.
    """
    donors = [
        DonorPull(
            id=nid,
            bytes=stats.bytes_per_donor.get(nid, 0),
            shards=stats.shards_per_donor.get(nid, 0),
            elapsed_s=min(stats.elapsed_per_donor.get(nid, 0.0), 1e9),
            ranges=ranges if len(ranges) <= MAX_PULL_RANGES else [],
            failed=stats.failed_donors.get(nid, "")[:64],
        )
        for nid, ranges in sorted(stats.ranges_per_donor.items())
    ]
    return PullReport(reason=reason, per_shard_cost_s=plan.per_shard_cost_s,
                      replans=stats.replans, state_bytes=state_bytes, donors=donors)  # fmt: skip
