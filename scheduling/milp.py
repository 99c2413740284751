"""MILP reference solver (PuLP + CBC) for the shard assignment, and a brute force for tiny cases.

At a fixed shard size s the problem P3 is solved in one of two forms:

* **binary form** (the paper's x_uj): one binary per (neighbour, shard). Used when the instance
  has at most ``BINARY_FORM_LIMIT`` such binaries, because CBC stops proving optimality well
  beyond about 100 of them.
* **integer-count form**: shards of equal length are interchangeable, so one integer n_ui per
  (neighbour, shard-length class) suffices. Large instances solve in milliseconds.

Both add a binary z_u per neighbour, so that a neighbour that sends nothing costs nothing (the
paper's |K_u| > 0 is dropped on purpose).

Over s, the solver scans the candidate sizes of :func:`layout.candidate_shard_sizes` (the paper's
"brute-force search (lower bound)"). It skips a candidate only when a valid lower bound proves
that it cannot beat the incumbent: for equal shards the earliest-finish greedy is optimal, so the
greedy value with every shard shrunk to the shortest length bounds every plan at that s from below.

CBC reports "Optimal" even when it stopped at its time limit, so optimality is read from
``prob.sol_status == 1`` only, and every solve has a time limit.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import pulp
from chaos.scheduling.bounds import shard_lower_bound
from chaos.scheduling.greedy import greedy_counts, realize
from chaos.scheduling.layout import candidate_shard_sizes, cut_shards, shard_classes
from chaos.scheduling.model import Neighbor, makespan

from chaos.errors import SolverError

BINARY_FORM_LIMIT = 40
"""Largest |U| * K for which the paper's binary form is tried first. Equal shards make the binary
form highly symmetric, and CBC then fails to prove optimality within 10 s on some instances with
as few as 75 binaries; when the binary form is not proven, the count form re-solves it."""

DEFAULT_TIME_LIMIT_S = 10.0
"""Time limit of one CBC solve. Raise it for large per-tensor instances."""


@dataclass(frozen=True)
class MilpResult:
    """One MILP solve at a fixed shard size."""

    shard_size: int
    makespan_s: float
    assignment: dict[str, list[tuple[int, int]]]
    proven_optimal: bool
    form: str
    solves: int = 1


def _solve(prob: pulp.LpProblem, time_limit_s: float) -> bool:
    """Runs CBC and returns whether it proved optimality.

    Raises:
        SolverError: CBC found no feasible solution.
    """
    with warnings.catch_warnings():
        # PuLP 3.x deprecates its bundled CBC in favour of `pulp[cbc]`; the bundled binary is what
        # works offline, and pyproject pins pulp < 4, which still ships it.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=0.0)
        prob.solve(solver)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SolverError(f"CBC found no feasible solution (sol_status={prob.sol_status})")
    return bool(prob.sol_status == pulp.LpSolutionOptimal)


def _value(var: pulp.LpVariable) -> int:
    v = var.value()
    return int(round(v)) if v is not None else 0


def _count_form(
    classes: Sequence[tuple[int, int]], neighbors: Sequence[Neighbor], c: float, limit_s: float
) -> tuple[list[list[int]], bool]:
    prob = pulp.LpProblem("p3_counts", pulp.LpMinimize)
    theta = prob.add_variable("theta", lowBound=0)
    prob += theta
    n = [
        [
            prob.add_variable(f"n_{u}_{i}", lowBound=0, upBound=k, cat="Integer")
            for u in range(len(neighbors))
        ]
        for i, (_, k) in enumerate(classes)
    ]
    z = [prob.add_variable(f"z_{u}", cat="Binary") for u in range(len(neighbors))]
    for i, (_, k) in enumerate(classes):
        prob += pulp.lpSum(n[i]) == k
        for u in range(len(neighbors)):
            prob += n[i][u] <= k * z[u]
    for u, nb in enumerate(neighbors):
        work = pulp.lpSum(
            n[i][u] * (length * nb.trans_s_per_byte + c) for i, (length, _) in enumerate(classes)
        )
        prob += theta >= nb.start_s * z[u] + work
    proven = _solve(prob, limit_s)
    return [[_value(v) for v in row] for row in n], proven


def _binary_form(
    shards: Sequence[tuple[int, int]], neighbors: Sequence[Neighbor], c: float, limit_s: float
) -> tuple[dict[str, list[tuple[int, int]]], bool]:
    prob = pulp.LpProblem("p3_binary", pulp.LpMinimize)
    theta = prob.add_variable("theta", lowBound=0)
    prob += theta
    x = [
        [prob.add_variable(f"x_{u}_{j}", cat="Binary") for j in range(len(shards))]
        for u in range(len(neighbors))
    ]
    z = [prob.add_variable(f"z_{u}", cat="Binary") for u in range(len(neighbors))]
    for j in range(len(shards)):
        prob += pulp.lpSum(x[u][j] for u in range(len(neighbors))) == 1
    for u, nb in enumerate(neighbors):
        for j in range(len(shards)):
            prob += x[u][j] <= z[u]
        work = pulp.lpSum(
            x[u][j] * (length * nb.trans_s_per_byte + c) for j, (_, length) in enumerate(shards)
        )
        prob += theta >= nb.start_s * z[u] + work
    proven = _solve(prob, limit_s)
    out = {
        nb.id: [shards[j] for j in range(len(shards)) if _value(x[u][j]) == 1]
        for u, nb in enumerate(neighbors)
    }
    return out, proven


def solve_fixed(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
    shard_size: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> MilpResult:
    """Solves P3 exactly (up to the time limit) at one shard size.

    Raises:
        SolverError: CBC failed to find any solution.
    """
    shards = cut_shards(tensor_sizes, shard_size, layout)
    proven = False
    form = ""
    if len(shards) * len(neighbors) <= BINARY_FORM_LIMIT:
        assignment, proven = _binary_form(shards, neighbors, per_shard_cost_s, time_limit_s)
        form = "binary"
    if not proven:  # large, or the binary form hit its time limit (shard symmetry)
        classes = shard_classes(tensor_sizes, shard_size, layout)
        counts, proven = _count_form(classes, neighbors, per_shard_cost_s, time_limit_s)
        assignment = realize(shards, classes, counts, neighbors)
        form = "binary+count" if form else "count"
    span = makespan(assignment, neighbors, per_shard_cost_s)
    return MilpResult(shard_size, span, assignment, proven, form)


def _equal_shard_bound(
    tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor], c: float, layout: str, s: int
) -> float:
    """Lower bound at shard size s: the larger of two valid bounds.

    * every shard shrunk to the shortest one: shards are then equal, and the greedy is exact;
    * the longest shards alone, the others dropped: again equal shards (tight for ``"flat"``,
      where only the last shard is shorter);
    * water-filling with a per-byte rate of ``trans + c / s`` (each shard holds <= s bytes).
    """
    classes = shard_classes(tensor_sizes, s, layout)
    shortest = classes[-1][0]
    total = sum(k for _, k in classes)
    shrunk = greedy_counts([(shortest, total)], neighbors, c)[1]
    longest = greedy_counts(classes[:1], neighbors, c)[1]
    return max(shrunk, longest, shard_lower_bound(sum(tensor_sizes), neighbors, c, s))


def milp_search(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
    min_shard_bytes: int,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    total_time_limit_s: float | None = None,
) -> MilpResult:
    """Best MILP solution over the candidate shard sizes (bound-pruned scan).

    Args:
        time_limit_s: CBC time limit per solve, in seconds.
        total_time_limit_s: Budget for the whole scan; when it runs out the best solution so far
            is returned with ``proven_optimal=False``. ``None`` means no budget.

    Returns:
        The best solve; ``proven_optimal`` is True only if every solve it relied on was proven
        optimal and no candidate was left unexamined.
    """
    t0 = time.perf_counter()
    cands = candidate_shard_sizes(tensor_sizes, layout, min_shard_bytes)
    bounds = sorted(
        (_equal_shard_bound(tensor_sizes, neighbors, per_shard_cost_s, layout, s), -s)
        for s in cands
    )
    best: MilpResult | None = None
    all_proven = True
    solves = 0
    for bound, neg_s in bounds:
        if best is not None and bound >= best.makespan_s * (1 - 1e-12):
            break
        if (  # the budget stops the scan, but only after one solve: running out is no failure
            best is not None
            and total_time_limit_s is not None
            and time.perf_counter() - t0 > total_time_limit_s
        ):
            all_proven = False
            break
        res = solve_fixed(tensor_sizes, neighbors, per_shard_cost_s, layout, -neg_s, time_limit_s)
        solves += 1
        all_proven = all_proven and res.proven_optimal
        if best is None or res.makespan_s < best.makespan_s:
            best = res
    if best is None:
        raise SolverError("MILP scan examined no candidate shard size")
    return MilpResult(
        best.shard_size, best.makespan_s, best.assignment, all_proven, best.form, solves
    )


def brute_force(
    shard_lengths: Sequence[int], neighbors: Sequence[Neighbor], per_shard_cost_s: float
) -> float:
    """Exact optimum of P3 by enumerating every assignment. Only for tiny cases (|U|^K <= 1e6).

    Raises:
        ValueError: the instance is too large to enumerate.
    """
    if len(neighbors) ** len(shard_lengths) > 1_000_000:
        raise ValueError("brute force is limited to |U|^K <= 1e6 assignments")
    best = float("inf")
    for owners in itertools.product(range(len(neighbors)), repeat=len(shard_lengths)):
        loads = [0.0] * len(neighbors)
        used = [False] * len(neighbors)
        for length, u in zip(shard_lengths, owners, strict=True):
            loads[u] += length * neighbors[u].trans_s_per_byte + per_shard_cost_s
            used[u] = True
        span = max(loads[u] + neighbors[u].start_s for u in range(len(neighbors)) if used[u])
        best = min(best, span)
    return best
