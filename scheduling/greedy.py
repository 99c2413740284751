"""Algorithm 2 of the paper: greedy shard assignment at a fixed shard size (problem P3).

Each shard goes to the neighbour where it would *finish earliest*: ``argmin_u l_u + b_u`` with
``l_u`` the neighbour's current load and ``b_u = length * trans_u + c`` the shard's cost there.

For a run of equal shards this greedy picks, one by one, the smallest values of the merged
sequences ``l_u + k * b_u`` (k = 1, 2, ...). :func:`take_earliest` computes the same counts in
``O(|U| log |U|)`` instead of ``O(K |U|)``: it fills the continuous water level, rounds down, and
finishes with at most ``|U|`` heap steps. :func:`greedy_reference` is the literal per-shard loop,
kept as the executable definition that the tests compare against.

For equal shards the greedy is optimal for P3 (any assignment with makespan theta has at most
``sum_u floor((theta - l_u) / b_u)`` shards), which ``tests/scheduling/test_scheduling_milp.py``
checks against the MILP.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from chaos.scheduling.bounds import water_level
from chaos.scheduling.model import Neighbor


def take_earliest(loads: Sequence[float], costs: Sequence[float], m: int) -> list[int]:
    """Counts how many of ``m`` equal shards each neighbour gets under the greedy rule.

    Args:
        loads: Current finish time of each neighbour (its start time if it has nothing yet).
        costs: Time one more shard adds on each neighbour (> 0).
        m: Number of shards to place (>= 0).

    Returns:
        Per-neighbour counts summing to ``m``; the chosen finish times are the ``m`` smallest
        of the merged sequences ``loads[u] + k * costs[u]``.
    """
    n = len(loads)
    if m <= 0:
        return [0] * n
    level = water_level(loads, [1.0 / b for b in costs], float(m))
    counts = [max(0, math.floor((level - ld) / b)) for ld, b in zip(loads, costs, strict=True)]
    excess = sum(counts) - m
    if excess > 0:  # rounding put the level a hair too high: drop the latest finishes
        late = [(-(loads[u] + counts[u] * costs[u]), u) for u in range(n) if counts[u] > 0]
        heapq.heapify(late)
        for _ in range(excess):
            _, u = heapq.heappop(late)
            counts[u] -= 1
            if counts[u] > 0:
                heapq.heappush(late, (-(loads[u] + counts[u] * costs[u]), u))
    missing = m - sum(counts)
    if missing > 0:
        nxt = [(loads[u] + (counts[u] + 1) * costs[u], u) for u in range(n)]
        heapq.heapify(nxt)
        for _ in range(missing):
            t, u = heapq.heappop(nxt)
            counts[u] += 1
            heapq.heappush(nxt, (t + costs[u], u))
    return counts


def greedy_counts(
    classes: Sequence[tuple[int, int]],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
) -> tuple[list[list[int]], float]:
    """Runs Algorithm 2 over shard classes, largest shards first.

    Args:
        classes: ``[(length, count), ...]`` in decreasing length (see ``layout.shard_classes``).
        neighbors: The joiner's neighbours.
        per_shard_cost_s: Per-shard cost c, in seconds.

    Returns:
        ``(counts, makespan_s)`` where ``counts[i][u]`` is how many shards of class ``i``
        neighbour ``u`` sends.
    """
    loads = [n.start_s for n in neighbors]
    used = [False] * len(neighbors)
    per_class: list[list[int]] = []
    for length, count in classes:
        costs = [length * n.trans_s_per_byte + per_shard_cost_s for n in neighbors]
        counts = take_earliest(loads, costs, count)
        for u, k in enumerate(counts):
            if k:
                loads[u] += k * costs[u]
                used[u] = True
        per_class.append(counts)
    span = max((ld for ld, is_used in zip(loads, used, strict=True) if is_used), default=0.0)
    return per_class, span


def greedy_reference(
    shard_lengths: Sequence[int], neighbors: Sequence[Neighbor], per_shard_cost_s: float
) -> list[int]:
    """The paper's Algorithm 2, literally: one shard at a time, in the given order.

    Returns:
        For each shard, the index of the neighbour it goes to.
    """
    loads = [n.start_s for n in neighbors]
    owner: list[int] = []
    for length in shard_lengths:
        best = min(
            range(len(neighbors)),
            key=lambda u: loads[u] + length * neighbors[u].trans_s_per_byte + per_shard_cost_s,
        )
        loads[best] += length * neighbors[best].trans_s_per_byte + per_shard_cost_s
        owner.append(best)
    return owner


def realize(
    shards: Sequence[tuple[int, int]],
    classes: Sequence[tuple[int, int]],
    counts: Sequence[Sequence[int]],
    neighbors: Sequence[Neighbor],
) -> dict[str, list[tuple[int, int]]]:
    """Turns per-class counts into concrete shard ranges.

    Each neighbour receives its shards of a class as one run of consecutive shards of that
    length, in stream order, so the ranges a neighbour sends are as contiguous as possible.

    Raises:
        ValueError: the counts do not match the shards.
    """
    by_length: dict[int, list[tuple[int, int]]] = {}
    for shard in shards:
        by_length.setdefault(shard[1], []).append(shard)
    out: dict[str, list[tuple[int, int]]] = {n.id: [] for n in neighbors}
    for (length, count), per_u in zip(classes, counts, strict=True):
        pool = by_length.get(length, [])
        if len(pool) != count or sum(per_u) != count:
            raise ValueError(f"shard counts do not match the {count} shards of {length} bytes")
        pos = 0
        for n, k in zip(neighbors, per_u, strict=True):
            out[n.id].extend(pool[pos : pos + k])
            pos += k
    for ranges in out.values():
        ranges.sort()
    return out
