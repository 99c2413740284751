"""The member's side of data-plane membership: the local trainer's messages, relayed.

:class:`TrainerRelay` runs on every daemon. It forwards the local trainer's
:class:`~chaos.protocol.TrainerRegister` (as :class:`~chaos.protocol.TrainerInfo`) and its
answered events (:class:`~chaos.protocol.AnsweredEventBase`) to the scheduler, and remembers
what was accepted, so that its :class:`~chaos.protocol.AgentReport` lets a newly elected
scheduler rebuild the registration. The scheduler's side is
:class:`chaos.daemon.scheduler.registry.TrainerRegistry`; the contract is
docs/trainer-daemon-interface.md.

The relay also watches the trainer's process (the ``pid`` of its registration): when it exits,
the registration ends and the scheduler is told (:class:`~chaos.protocol.TrainerGone`), so
that a dead trainer behind a live daemon leaves the sync policy instead of failing every step.

And it keeps the trainer's step progress: the trainer's one-way
:class:`~chaos.protocol.TrainerProgress` says where it is in its steps, and every heartbeat
interval the relay forwards the latest one to the scheduler with how long the trainer has been
silent since, so that the scheduler can find a trainer that holds the others up
(:mod:`chaos.daemon.scheduler.stragglers`). When the installed view shows this node's trainer
evicted as a straggler, the registration ends here too; the trainer registers again, as a
joiner, when it resumes. A trainer's one-way :class:`~chaos.protocol.NonfiniteStep` (a step it
skipped, and the devices whose gradients spoiled it) goes to the scheduler at once, which
evicts a repeat offender the same way (:mod:`chaos.daemon.scheduler.offenders`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
from chaos.daemon.dispatch import Handler, scheduler_side
from chaos.daemon.relayed import RelayedOps
from chaos.daemon.scheduler.role import DaemonContext, SchedulerRole
from chaos.daemon.transport import ReplyPath

from chaos.protocol import (
    AnsweredEvent,
    CaughtUp,
    NonfiniteStep,
    OpResult,
    PullDone,
    Reason,
    Refusal,
    StepFailed,
    TrainerGone,
    TrainerInfo,
    TrainerProgress,
    TrainerReady,
    TrainerRegister,
    TrainerThroughput,
    tag_of,
)
from chaos.protocol.messages import MAX_ELAPSED_S, AuditInfo
from chaos.protocol.states import TrainerPhase, TrainerState

THROUGHPUT_REFRESH_S = 5.0
"""The trainer's throughput goes to the scheduler at least this often while it changes little."""


def process_start(pid: int) -> float | None:
    """The start time of the live process ``pid`` (``None``: no such process, or a zombie).

    The start time tells a process from a later one that reuses its pid.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's process: it exists, but it cannot be told
        return 0.0


def _op_id(asked: str) -> str:
    """The op id a relayed trainer message goes under: the client's own when it named one (so
    that it can tell the answer from a late answer to an earlier op), else a fresh one."""
    return asked or uuid.uuid4().hex[:12]


class TrainerRelay:
    """The local daemon's side: forwards the trainer's messages and remembers what was accepted.

    Args:
        ctx: The daemon's context.
        relayed: The requests relayed to the scheduler (the trainer's go there).
    """

    def __init__(self, ctx: DaemonContext, relayed: RelayedOps) -> None:
        self.ctx = ctx
        self.relayed = relayed
        relayed.on_dropped.append(self.forget)
        self.registration: TrainerRegister | None = None
        self.sizes: list[int] | None = None
        self.state: TrainerState = TrainerState.NONE
        self._sent: dict[str, TrainerRegister | AnsweredEvent] = {}
        self._watched: tuple[int, float] | None = None  # the trainer's pid and start time
        self._gone: str = ""  # why the last registration ended (for ``status``)
        self._accepted_epoch = 0  # the scheduler's epoch when it accepted the registration
        self._progress: TrainerProgress | None = None  # the trainer's latest progress report
        self.audit: AuditInfo | None = None  # the trainer's last reported state audit
        self.phase: TrainerPhase | None = None  # the trainer's last reported lifecycle phase
        self._progress_at = 0.0  # when it came (monotonic)
        self._rate_sent: tuple[float, int] | None = None  # throughput, global batch forwarded
        self._rate_sent_at = 0.0

    def handlers(self) -> dict[type, Handler]:
        """The trainers flow: the local trainer's registration and events (relayed to the
        scheduler), and on the scheduler's side the registrations and events the members
        forward."""
        side = self.ctx.facts
        answered = lambda n, m, r, t: n.trainers.on_event(m, r, t)  # noqa: E731
        return {
            TrainerRegister: lambda m, r, t: self.on_register(m, r),
            TrainerInfo: scheduler_side(side, lambda n, m, r, t: n.trainers.on_info(m, r, t)),
            TrainerReady: self._event(self.on_event, answered),
            PullDone: self._event(self.on_event, answered),
            CaughtUp: self._event(self.on_event, answered),
            StepFailed: self._event(self.on_event, SchedulerRole.on_step_failed),
            TrainerGone: self._event(self.on_event, SchedulerRole.on_trainer_gone),
            TrainerProgress: self._event(lambda m, r: self.on_progress(m),
                                         lambda n, m, r, t: n.on_trainer_progress(m, t)),
            NonfiniteStep: self._event(lambda m, r: self.on_nonfinite(m),
                                       lambda n, m, r, t: n.on_nonfinite(m, t)),
            TrainerThroughput: self._event(lambda m, r: self.on_throughput(m),
                                           lambda n, m, r, t: n.trainers.on_throughput(m)),
        }  # fmt: skip

    def _event(
        self,
        local: Callable[[Any, ReplyPath | None], None],
        forwarded: Callable[[SchedulerRole, Any, ReplyPath | None, float], None],
    ) -> Handler:
        """A trainer event's handler: ``local`` (this relay's) for one from this node's
        trainer (``node_id`` unset), ``forwarded`` (the scheduler's side) for one a member
        forwarded."""
        scheduler = scheduler_side(self.ctx.facts, forwarded)

        def handler(msg: Any, reply: ReplyPath | None, now: float) -> None:
            if msg.node_id is None:
                local(msg, reply)
            else:
                scheduler(msg, reply, now)

        return handler

    def on_register(self, msg: TrainerRegister, reply: ReplyPath | None) -> None:
        """Forwards a registration to the scheduler as :class:`TrainerInfo`."""
        if not self.ctx.facts.active:
            self.ctx.result(reply, msg.op_id, Reason.UNKNOWN_PEER,
                             "this daemon is not a member (yet)")  # fmt: skip
            return
        op_id = _op_id(msg.op_id)
        self._sent[op_id] = msg
        info = TrainerInfo(
            sender=self.ctx.node_id,
            epoch=self.ctx.facts.epoch,
            node_id=self.ctx.node_id,
            data_address=msg.data_address,
            shard_address=msg.shard_address,
            has_state=msg.has_state,
            tensor_sizes=msg.tensor_sizes,
            op_id=op_id,
            state_digest=msg.state_digest,
            data_key=msg.public_key,
            catch_up=msg.catch_up,
        )
        self.relayed.relay(reply, info, op_id)

    def on_event(self, msg: AnsweredEvent, reply: ReplyPath | None) -> None:
        """Forwards an answered trainer event (ready, a pull done, a failed step, caught up)
        to the scheduler, stamped with this node's id; the scheduler's answer goes back to the
        trainer."""
        if not self.ctx.facts.active:
            self.ctx.result(reply, msg.op_id, Reason.UNKNOWN_PEER,
                             "this daemon is not a member (yet)")  # fmt: skip
            return
        if isinstance(msg, TrainerReady) and self.registration is not None:
            self._start_silence_clock(msg.step)
        op_id = _op_id(msg.op_id)
        self._sent[op_id] = msg
        me = self.ctx.node_id
        # a failed step names the epoch it ran under; other events carry this daemon's epoch
        epoch = msg.epoch if isinstance(msg, StepFailed) else self.ctx.facts.epoch
        fwd = msgspec.structs.replace(msg, sender=me, node_id=me, epoch=epoch, op_id=op_id)
        self.relayed.relay(reply, fwd, op_id)

    def on_progress(self, msg: TrainerProgress) -> None:
        """Keeps the trainer's step progress (one-way, never answered): forwarded at the next
        heartbeat; its audit and phase are kept for ``status``."""
        if msg.audit is not None:
            self.audit = msg.audit  # kept for status, whatever the registration
        if msg.phase is not None:
            self.phase = msg.phase  # kept for status, whatever the registration
        if self.registration is not None:
            self._progress = msg
            self._progress_at = time.monotonic()

    def on_throughput(self, msg: TrainerThroughput) -> None:
        """Drops a trainer's throughput event: it is the daemon's to send (the trainer's
        throughput rides in its progress, :meth:`_report_throughput`)."""

    def on_nonfinite(self, msg: NonfiniteStep) -> None:
        """Forwards the trainer's report of a step it skipped as non-finite (the devices named)
        to the scheduler at once, one way, which evicts a repeat offender
        (:mod:`chaos.daemon.scheduler.offenders`); dropped without a registration."""
        if self.registration is None or not self.ctx.facts.active:
            return
        me = self.ctx.node_id
        self.ctx.out.to_scheduler(
            NonfiniteStep(sender=me, epoch=self.ctx.facts.epoch, node_id=me, step=msg.step,
                          devices=msg.devices)
        )  # fmt: skip

    def on_result(self, msg: OpResult) -> None:
        """Notes the scheduler's answer to a forwarded message."""
        sent = self._sent.pop(msg.op_id, None)
        if sent is None or not msg.ok:
            return
        if isinstance(sent, TrainerRegister):
            self.registration = sent
            self._gone = ""
            self._accepted_epoch = msg.epoch
            if not sent.has_state:  # a new trainer (or one that rejoins): no progress yet
                self._progress = None
            self._watch(sent.pid)
            self.state = TrainerState.TRAINING if sent.has_state else TrainerState.SYNCING
            if sent.has_state and sent.tensor_sizes is not None:
                self.sizes = list(sent.tensor_sizes)
        elif isinstance(sent, TrainerReady):
            self.state = TrainerState.TRAINING

    def _start_silence_clock(self, step: int) -> None:
        """The trainer is ready at ``step``: what it said while it pulled the state no longer
        counts, and it is heard now (a report it sends from here on replaces this one). A
        trainer stopped before its first progress report is so still reported, silent since
        its ready, and found a straggler."""
        self._progress = TrainerProgress(step=step)
        self._progress_at = time.monotonic()

    def on_refusal(self, msg: Refusal) -> str | None:
        """The op id of the forwarded message a scheduler refused (the oldest of its type)."""
        for op_id, sent in self._sent.items():
            tag = "trainer_info" if isinstance(sent, TrainerRegister) else tag_of(sent)
            if tag == msg.ref_type:
                del self._sent[op_id]
                return op_id
        return None

    def _watch(self, pid: int | None) -> None:
        """Starts watching the registered trainer's process (not this daemon's own: an embedded
        daemon dies with its trainer; not one this host cannot see)."""
        start = process_start(pid) if pid is not None and pid != os.getpid() else None
        self._watched = (pid, start) if pid is not None and start is not None else None
        self.ctx.event("trainer_watched", pid=pid, watched=self._watched is not None)

    def check_trainer(self) -> bool:
        """Runs every heartbeat: ends the registration of a trainer whose process exited, and
        tells the scheduler; else ends the registration of a trainer the scheduler evicted as a
        straggler, or forwards the trainer's latest progress report to the scheduler.

        Returns:
            Whether the trainer was found gone now.
        """
        if self._check_process():
            return True
        if not self._check_evicted():
            self._report_progress(time.monotonic())
        return False

    def _check_evicted(self) -> bool:
        """Ends the registration when the installed view (at least as new as the registration)
        shows this node without a trainer: the scheduler evicted it (a straggler, or a repeat
        non-finite offender).

        Returns:
            Whether it ended now.
        """
        view = self.ctx.facts.view
        if self.registration is None or view is None or view.epoch < self._accepted_epoch:
            return False
        me = next((n for n in view.nodes if n.id == self.ctx.node_id), None)
        if me is None or me.trainer != TrainerState.NONE:
            return False
        was = self.state
        self._end_registration()
        stamp = time.strftime("%H:%M:%S")
        self._gone = (
            f"trainer evicted (a straggler, or a repeat non-finite offender) at {stamp} "
            f"(epoch {view.epoch}); it joins again when it resumes"
        )
        self.ctx.event("trainer_evicted", was=was.value, epoch=view.epoch)
        return True

    def _report_progress(self, now: float) -> None:
        """Forwards the trainer's latest progress report to the scheduler (one-way), aged to
        ``now``: ``silent_s`` since it came, and its phase that much longer."""
        last = self._progress
        if self.registration is None or last is None or not self.ctx.facts.active:
            return
        me = self.ctx.node_id
        silent = min(max(0.0, now - self._progress_at), MAX_ELAPSED_S)
        self.ctx.out.to_scheduler(
            TrainerProgress(
                sender=me, epoch=self.ctx.facts.epoch, node_id=me, step=last.step,
                in_step=last.in_step, elapsed_s=last.elapsed_s + silent, silent_s=silent,
                pulling=last.pulling, phase=last.phase,
            )
        )  # fmt: skip
        self._report_throughput(last, now)

    def _report_throughput(self, last: TrainerProgress, now: float) -> None:
        """Forwards the trainer's throughput and global batch (a one-way
        :class:`~chaos.protocol.TrainerThroughput`)
        when they changed by over 2 % since last forwarded, or every
        :data:`THROUGHPUT_REFRESH_S` (a new scheduler learns them so)."""
        rate, batch = last.samples_per_s, last.global_batch
        if rate <= 0.0 or batch <= 0:
            return
        sent = self._rate_sent
        fresh = now - self._rate_sent_at < THROUGHPUT_REFRESH_S
        steady = sent is not None and sent[1] == batch and abs(rate - sent[0]) <= 0.02 * sent[0]
        if fresh and steady:
            return
        me = self.ctx.node_id
        self.ctx.out.to_scheduler(
            TrainerThroughput(
                sender=me, epoch=self.ctx.facts.epoch, node_id=me, samples_per_s=rate,
                global_batch=batch,
            )
        )  # fmt: skip
        self._rate_sent, self._rate_sent_at = (rate, batch), now

    def _end_registration(self) -> None:
        self._watched = None
        self.registration = None
        self.sizes = None
        self.state = TrainerState.NONE
        self._progress = None

    def _check_process(self) -> bool:
        """Ends the registration of a trainer whose process exited, and tells the scheduler.

        Returns:
            Whether the trainer was found gone now.
        """
        if self._watched is None:
            return False
        pid, start = self._watched
        now_start = process_start(pid)
        if now_start is not None and (start == 0.0 or abs(now_start - start) < 1e-3):
            return False
        was = self.state
        self._end_registration()
        stamp = time.strftime("%H:%M:%S")
        self._gone = f"trainer process {pid} exited at {stamp}; this node no longer trains"
        self.ctx.event("trainer_gone", pid=pid, was=was.value)
        if self.ctx.facts.active:
            op_id = uuid.uuid4().hex[:12]
            me = self.ctx.node_id
            msg = TrainerGone(
                sender=me, epoch=self.ctx.facts.epoch, node_id=me, op_id=op_id,
                detail=f"pid {pid} exited",
            )  # fmt: skip
            self._sent[op_id] = msg
            self.relayed.relay(None, msg, op_id)
        return True

    def notes(self) -> list[str]:
        """Lines for ``status``: a trainer that exited."""
        return [self._gone] if self._gone else []

    def forget(self, op_id: str) -> None:
        """Drops a forwarded message that timed out."""
        self._sent.pop(op_id, None)

    def report_fields(self) -> dict[str, Any]:
        """The trainer fields of this node's :class:`~chaos.protocol.AgentReport`."""
        reg = self.registration
        if reg is None:  # after its trainer exited, a new scheduler must not restore it
            return {"trainer": TrainerState.NONE} if self._gone else {}
        return {
            "data_address": reg.data_address,
            "shard_address": reg.shard_address,
            "trainer": self.state,
            "tensor_sizes": self.sizes if self.state == "training" else None,
        }
