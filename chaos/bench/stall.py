"""The stall estimator of ``chaos-bench primitives``: pure functions over logged steps, no I/O.

A step record is a dict with ``t0`` (when its gradient computation began) and ``t1`` (when
``update()`` and ``check_state_replication()`` returned), both wall-clock seconds, ``epoch``
(the policy it ran under) and ``step`` (its number). :func:`span` picks the steps a primitive
spans for one member;
:func:`null_stalls_s` applies the same estimator to undisturbed steps (the placebo). The
benchmark (:mod:`chaos.bench.primitives`) runs the cluster, reads the logs and feeds them here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from chaos.errors import ChaosError

NULL_DRAWS = 8
"""Placebo samples drawn per primitive sample, from different quiet steps: the null's p50 is
then estimated from ``NULL_DRAWS`` times as many samples as the stall's, so that most of the
noise left in ``added_p50_ms`` is the stall's own."""


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``; NaN when empty."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary_ms(xs_s: list[float]) -> dict[str, Any]:
    """``{"p50", "p99", "n", "samples"}`` in milliseconds of durations given in seconds."""
    ms = [x * 1e3 for x in xs_s]
    return {
        "p50": statistics.median(ms) if ms else float("nan"),
        "p99": percentile(ms, 99),
        "n": len(ms),
        "samples": [round(x, 4) for x in ms],
    }


@dataclass
class Primitive:
    """One primitive applied to the running cluster, as the estimator needs it.

    ``kind`` is one of ``scale_in``, ``connect_link``, ``disconnect_link``; ``t_req`` is when it
    was requested (wall clock), ``control_s`` how long the request took, ``survivors`` the
    members that trained through it and ``epoch_after`` the settled epoch they reached.
    ``t_settled`` is filled in once the run's logs are read.
    """

    kind: str
    t_req: float
    control_s: float
    survivors: list[str]
    epoch_after: int
    t_settled: float = 0.0
    link: tuple[str, str] | None = None
    """The link a connect-link added (its bandwidth probe runs after the new epoch)."""
    t_probed: float = 0.0
    """When that link's last bandwidth measurement ended (0: none seen)."""


def span(steps: list[dict[str, Any]], p: Primitive, n: str) -> list[dict[str, Any]]:
    """Member ``n``'s spanning steps of ``p``, in step order.

    They are the step that was running when the request was made, the steps in which ``n``
    installed a newer epoch up to its first step under ``p.epoch_after``, and every later step
    that began before ``p.t_probed`` (a connect-link's bandwidth probe).

    Raises:
        ChaosError: ``n`` logged no step under ``p.epoch_after``.
    """
    installs: list[dict[str, Any]] = []
    prev: int | None = None
    for r in steps:
        if r["t1"] > p.t_req and prev is not None and r["epoch"] != prev:
            installs.append(r)
            if r["epoch"] >= p.epoch_after:
                break
        prev = r["epoch"]
    else:
        raise ChaosError(f"{n} logged no step under epoch {p.epoch_after}")
    chosen = {id(r) for r in installs}
    first = installs[0]["t0"]
    return [
        r
        for r in steps
        if id(r) in chosen
        or (r["t1"] > p.t_req and r["t0"] < first)  # running when the request was made
        or first < r["t0"] < p.t_probed
    ]


def null_stall_s(
    quiet: dict[str, dict[int, float]], spans: dict[str, int], baseline_s: float, pick: int
) -> float | None:
    """The primitive's stall estimator (the worst member's extra time over its spanning steps)
    applied to undisturbed steps: the placebo.

    Taking the worst of several members' noisy step durations is above the median even when
    nothing happens; this measures by how much. It takes the members' steps from a step number
    at which every member of ``spans`` ran that many quiet steps in a row.

    Args:
        quiet: Per member, its quiet steps' durations by step number.
        spans: Per member, how many steps the real primitive spanned.
        baseline_s: The median undisturbed step.
        pick: Which of the eligible start steps to use (taken modulo their count), so that
            successive samples come from different parts of the run.

    Returns:
        The placebo stall, or ``None`` when no step number qualifies.
    """
    nulls = null_stalls_s(quiet, spans, baseline_s, [pick])
    return nulls[0] if nulls else None


def null_stalls_s(
    quiet: dict[str, dict[int, float]], spans: dict[str, int], baseline_s: float, picks: list[int]
) -> list[float]:
    """:func:`null_stall_s` for each of ``picks``, finding the eligible start steps once.

    Returns:
        One placebo stall per pick, or none when no step number qualifies.
    """
    if not spans or any(n not in quiet for n in spans):
        return []
    common = set.intersection(*(set(quiet[n]) for n in spans))
    starts = sorted(
        s for s in common if all(s + i in quiet[n] for n, k in spans.items() for i in range(k))
    )
    if not starts:
        return []
    return [
        max(sum(quiet[n][s0 + i] for i in range(k)) - k * baseline_s for n, k in spans.items())
        for s0 in (starts[pick % len(starts)] for pick in picks)
    ]
