"""``plan_replication``: the one entry point that turns a joiner's neighbourhood into a Plan."""

from __future__ import annotations

import enum
import math
import operator
import time
from collections.abc import Sequence
from typing import NamedTuple

from chaos.scheduling.layout import (
    DEFAULT_MIN_SHARD_BYTES,
    check_shard_size,
    validate_problem,
)
from chaos.scheduling.milp import DEFAULT_TIME_LIMIT_S, milp_search, solve_fixed
from chaos.scheduling.model import Neighbor, Plan, makespan
from chaos.scheduling.search import (
    chaos_search,
    even_split,
    fixed_search,
    scan_search,
    single_source,
)


class PlanMethod(str, enum.Enum):
    """The shard planner's methods (also the names the replication policy carries on the wire).

    ``chaos`` is Algorithms 1 and 2 (binary search over the shard size, greedy inside), ``scan``
    tries every candidate shard size, ``milp`` is the PuLP/CBC reference (slow: benchmarks and
    tests only), ``even`` and ``single-source`` are the baselines.
    """

    CHAOS = "chaos"
    SCAN = "scan"
    MILP = "milp"
    EVEN = "even"
    SINGLE_SOURCE = "single-source"


METHODS: tuple[str, ...] = tuple(m.value for m in PlanMethod)
"""Every :class:`PlanMethod`'s name."""

_Problem = tuple[list[int], Sequence[Neighbor], float, str]
"""``(tensor_sizes, neighbors, per_shard_cost_s, layout)``: the arguments every method takes."""


class _Solution(NamedTuple):
    """What a planning method produced, before it is evaluated into a :class:`Plan`."""

    shard_size: int
    assignment: dict[str, list[tuple[int, int]]]
    proven_optimal: bool | None
    extra: dict[str, float]


def _as_sizes(tensor_sizes: Sequence[int]) -> list[int]:
    """Plain ``int`` sizes; integer types such as numpy's are accepted, bools and floats are not.

    Raises:
        ValueError: a size is not an integer.
    """
    out = []
    for i, size in enumerate(tensor_sizes):
        if isinstance(size, bool):
            raise ValueError(f"tensor_sizes[{i}] must be an int number of bytes, got {size!r}")
        try:
            out.append(operator.index(size))
        except TypeError:
            raise ValueError(
                f"tensor_sizes[{i}] must be an int number of bytes, got {size!r}"
            ) from None
    return out


def plan_replication(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str = "flat",
    method: str = "chaos",
    *,
    shard_size: int | None = None,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    total_time_limit_s: float | None = None,
) -> Plan:
    """Plans which neighbour sends which shards of the training state to a joining node.

    Args:
        tensor_sizes: Byte size of every tensor of the state, in canonical stream order.
        neighbors: The joiner's neighbours with measured link parameters (unique ids).
        per_shard_cost_s: Fixed cost c of one shard message, in seconds. Measure it on the
            transport (``chaos-bench shard-cost``); it is what makes very small shards slow.
        layout: ``"flat"`` (one byte stream) or ``"per-tensor"`` (shards never cross tensors).
        method: ``"chaos"`` (Algorithm 1 + 2), ``"scan"`` (Algorithm 2 at every candidate s),
            ``"milp"`` (PuLP/CBC reference), ``"even"`` or ``"single-source"``.
        shard_size: Fix s instead of searching it (``"chaos"``, ``"scan"`` and ``"milp"``).
        min_shard_bytes: Smallest shard size the searches consider.
        time_limit_s: CBC time limit per solve (``"milp"`` only), in seconds.
        total_time_limit_s: Budget for the whole MILP scan, in seconds (``None``: unlimited).

    Returns:
        The plan. Its assignment is disjoint and covers the state byte for byte, and its
        ``makespan_s`` is the time model evaluated on that assignment.

    Raises:
        ValueError: bad input (no neighbours, duplicate ids, non-positive bandwidth, negative
            sizes, an empty state, an unknown layout or method, a bad shard size).
        chaos.errors.SolverError: the MILP solver failed (``"milp"`` only).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    tensor_sizes = _as_sizes(tensor_sizes)
    total = validate_problem(tensor_sizes, neighbors, per_shard_cost_s, layout)
    _check_options(method, shard_size, min_shard_bytes, time_limit_s, total_time_limit_s)
    t0 = time.perf_counter()
    args = (tensor_sizes, neighbors, per_shard_cost_s, layout)
    sol = _solve(method, args, shard_size, min_shard_bytes, time_limit_s, total_time_limit_s)
    solve_s = time.perf_counter() - t0
    return Plan(
        method=method,
        layout=layout,
        shard_size=sol.shard_size,
        assignment=sol.assignment,
        makespan_s=makespan(sol.assignment, neighbors, per_shard_cost_s),
        state_bytes=total,
        per_shard_cost_s=per_shard_cost_s,
        solve_s=solve_s,
        proven_optimal=sol.proven_optimal,
        extra=sol.extra,
    )


def _check_options(
    method: str,
    shard_size: int | None,
    min_shard_bytes: int,
    time_limit_s: float,
    total_time_limit_s: float | None,
) -> None:
    """Checks :func:`plan_replication`'s search options (shard sizes and time limits).

    Args:
        method: The planning method (already known to be one of :data:`METHODS`).
        shard_size: The fixed shard size, or ``None`` to search it.
        min_shard_bytes: Smallest shard size the searches consider.
        time_limit_s: CBC time limit per solve, in seconds.
        total_time_limit_s: Budget for the whole MILP scan, in seconds, or ``None``.

    Raises:
        ValueError: a bad shard size, a fixed shard size for a method that takes none, or a
            time limit that is not a positive (total: non-negative) finite number.
    """
    check_shard_size(min_shard_bytes)
    if shard_size is not None:
        check_shard_size(shard_size)
        if method not in ("chaos", "scan", "milp"):
            raise ValueError(f"shard_size applies to chaos, scan and milp, not to {method!r}")
    if not (isinstance(time_limit_s, (int, float)) and 0 < time_limit_s < math.inf):
        raise ValueError(f"time_limit_s must be a positive finite number, got {time_limit_s!r}")
    if total_time_limit_s is not None and not (
        isinstance(total_time_limit_s, (int, float)) and 0 <= total_time_limit_s < math.inf
    ):
        raise ValueError(f"total_time_limit_s must be >= 0 and finite, got {total_time_limit_s!r}")


def _solve(
    method: str,
    args: _Problem,
    shard_size: int | None,
    min_shard_bytes: int,
    time_limit_s: float,
    total_time_limit_s: float | None,
) -> _Solution:
    """Runs the planning method on a validated problem.

    Args:
        method: One of :data:`METHODS`.
        args: ``(tensor_sizes, neighbors, per_shard_cost_s, layout)``, validated.
        shard_size: The fixed shard size, or ``None`` to search it.
        min_shard_bytes: Smallest shard size the searches consider.
        time_limit_s: CBC time limit per solve (``"milp"`` only), in seconds.
        total_time_limit_s: Budget for the whole MILP scan (``"milp"`` only), or ``None``.

    Returns:
        The shard size, the assignment, whether CBC proved it optimal (``None`` for the
        heuristics) and the method's extra counters.

    Raises:
        chaos.errors.SolverError: the MILP solver failed (``"milp"`` only).
    """
    tensor_sizes, neighbors, _, layout = args
    if method == "even":
        s, assignment = even_split(tensor_sizes, neighbors, layout)
        return _Solution(s, assignment, None, {})
    if method == "single-source":
        s, assignment = single_source(*args)
        return _Solution(s, assignment, None, {})
    if method == "milp":
        if shard_size is not None:
            res = solve_fixed(*args, shard_size, time_limit_s)
        else:
            res = milp_search(*args, min_shard_bytes, time_limit_s, total_time_limit_s)
        extra = {"solves": float(res.solves)}
        return _Solution(res.shard_size, res.assignment, res.proven_optimal, extra)
    if shard_size is not None:
        best, assignment, evals = fixed_search(*args, shard_size)
    elif method == "chaos":
        best, assignment, evals = chaos_search(*args, min_shard_bytes)
    else:
        best, assignment, evals = scan_search(*args, min_shard_bytes)
    return _Solution(best.shard_size, assignment, None, {"evaluations": float(evals)})
