"""The step a catch-up joiner's snapshot is planned at, sized from what the scheduler measures.

A catch-up join's donors publish a copy of their state at the step boundary where it reaches the
planned step ``at_step``; the joiner waits for that boundary before it pulls, and the lower bound
of its replication leaves that wait out. So the step is the first boundary that every donor
reaches after the commit carrying the plan has reached it: the donors' step now, one step (the
boundary that ends it), and as many more as the commit's way to them outlasts the time left in
the current step. One spare step covers a step clock that runs slightly off (it is extrapolated
from progress reports) and the handling of the commit on its way; it is taken only while it
costs little against the plan's transfer time, since a donor that installs the plan late still
snapshots the step it is at (the joiner then pulls from the donors serving that step).
"""

from __future__ import annotations

import math

SPARE_STEP_SHARE = 0.1
"""A spare step is planned while the donors' step period is at most this share of the plan's
transfer time (it then adds at most this much to the replication)."""


def snapshot_step(
    step_now: int, period_s: float, next_boundary_s: float, reach_s: float, transfer_s: float
) -> int:
    """The step a catch-up snapshot is planned at.

    Args:
        step_now: The donors' step now (the step they compute, extrapolated from their reports).
        period_s: The donors' step period (seconds per step, measured).
        next_boundary_s: Seconds until the donors' next step boundary.
        reach_s: Seconds the commit carrying the plan takes to reach the donors (the measured
            latency of the scheduler's paths to them; 0 when unmeasured).
        transfer_s: The plan's transfer time (its makespan).

    Returns:
        ``step_now + 1`` (the state at the boundary that ends the current step), plus one step
        per period the commit's way outlasts ``next_boundary_s``, plus a spare step while the
        period is at most :data:`SPARE_STEP_SHARE` of ``transfer_s``.

    Raises:
        ValueError: a non-positive period, or a negative step, duration or transfer time.
    """
    if not period_s > 0.0 or not math.isfinite(period_s):
        raise ValueError(f"the donors' step period must be positive, got {period_s!r}")
    if step_now < 0:
        raise ValueError(f"the donors' step must not be negative, got {step_now}")
    for name, v in (("next_boundary_s", next_boundary_s), ("reach_s", reach_s),
                    ("transfer_s", transfer_s)):  # fmt: skip
        if not v >= 0.0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite non-negative duration, got {v!r}")
    late_s = max(0.0, reach_s - next_boundary_s)
    at = step_now + 1 + math.ceil(late_s / period_s)
    if period_s <= SPARE_STEP_SHARE * transfer_s:
        at += 1
    return at
