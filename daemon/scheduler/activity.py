"""What the scheduler shows of the training members and the joins in progress (``status``'s
``activity`` and ``joins``), from what its monitor heard; no I/O.

A member's step now is extrapolated from its last step boundary and smoothed period (its
:class:`~chaos.daemon.scheduler.monitor.RoundClock`); a join in progress is a member whose
trainer is syncing (pulling the state, or replaying a catch-up snapshot), with the last pull
progress its trainer reported.
"""

from __future__ import annotations

from chaos.daemon.scheduler.monitor import ClusterMonitor

from chaos.protocol import JoinActivity, MemberActivity, TrainerState
from chaos.protocol.messages import MAX_ACTIVITY, MAX_ELAPSED_S

__all__ = ["join_activity", "member_activity"]


def _age(now: float, then: float) -> float:
    return min(MAX_ELAPSED_S, max(0.0, now - then))


def member_activity(monitor: ClusterMonitor, now: float) -> list[MemberActivity]:
    """Every training member's step now, steps per second (0: not measured yet) and the age of
    its last report, sorted by id.

    Args:
        monitor: The scheduler's monitor.
        now: ``time.monotonic()``.
    """
    out = []
    for node in sorted(monitor.trainer_members((TrainerState.TRAINING,)))[:MAX_ACTIVITY]:
        clock = monitor.clocks.get(node)
        phase = monitor.phases.get(node)
        if clock is None:
            out.append(MemberActivity(id=node, phase=phase))
            continue
        period = clock.period_s if clock.period_s and clock.period_s > 0 else None
        step = clock.step + (int(max(0.0, now - clock.boundary_at) / period) if period else 0)
        out.append(MemberActivity(id=node, step=step, steps_per_s=1.0 / period if period else 0.0,
                                  heard_s=_age(now, clock.heard_at), phase=phase))  # fmt: skip
    return out


def join_activity(monitor: ClusterMonitor, now: float) -> list[JoinActivity]:
    """The joins in progress (members whose trainer is syncing), each with its trainer's last
    pull report and the donors that delivered to it so far, sorted by id."""
    out = []
    for node in sorted(monitor.trainer_members((TrainerState.SYNCING,)))[:MAX_ACTIVITY]:
        heard, phase = monitor.pulls.get(node), monitor.phases.get(node)
        if heard is None:
            out.append(JoinActivity(id=node, phase=phase))
            continue
        pull, at = heard
        donors = sorted(d for d, b in pull.donors.items() if b)
        out.append(JoinActivity(id=node, donors=donors, pull=pull, heard_s=_age(now, at),
                                phase=phase))  # fmt: skip
    return out
