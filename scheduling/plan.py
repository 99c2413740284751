"""``plan_replication``: the one entry point that turns a joiner's neighbourhood into a Plan."""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence

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

METHODS = ("chaos", "scan", "milp", "even", "single-source")


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
    t0 = time.perf_counter()
    proven: bool | None = None
    extra: dict[str, float] = {}
    args = (tensor_sizes, neighbors, per_shard_cost_s, layout)
    if method == "even":
        s, assignment = even_split(tensor_sizes, neighbors, layout)
    elif method == "single-source":
        s, assignment = single_source(*args)
    elif method == "milp":
        if shard_size is not None:
            res = solve_fixed(*args, shard_size, time_limit_s)
        else:
            res = milp_search(*args, min_shard_bytes, time_limit_s, total_time_limit_s)
        s, assignment, proven = res.shard_size, res.assignment, res.proven_optimal
        extra["solves"] = float(res.solves)
    else:
        if shard_size is not None:
            best, assignment, evals = fixed_search(*args, shard_size)
        elif method == "chaos":
            best, assignment, evals = chaos_search(*args, min_shard_bytes)
        else:
            best, assignment, evals = scan_search(*args, min_shard_bytes)
        s = best.shard_size
        extra["evaluations"] = float(evals)
    solve_s = time.perf_counter() - t0
    return Plan(
        method=method,
        layout=layout,
        shard_size=s,
        assignment=assignment,
        makespan_s=makespan(assignment, neighbors, per_shard_cost_s),
        state_bytes=total,
        per_shard_cost_s=per_shard_cost_s,
        solve_s=solve_s,
        proven_optimal=proven,
        extra=extra,
    )
