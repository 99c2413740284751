"""Algorithm 1 of the paper (binary search over the shard size s), the exhaustive scan, baselines.

All of these evaluate a shard size with Algorithm 2 (:mod:`chaos.scheduling.greedy`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chaos.scheduling.greedy import greedy_counts, realize
from chaos.scheduling.layout import candidate_shard_sizes, cut_shards, shard_classes
from chaos.scheduling.model import Neighbor

REFINE_WINDOW = 12
"""Candidates on each side of the binary search's result that Algorithm 2 also tries. Larger
values close more of the gap to ``"scan"`` at a linear cost in planning time."""


@dataclass(frozen=True)
class Evaluated:
    """Algorithm 2's result at one shard size."""

    shard_size: int
    makespan_s: float
    classes: list[tuple[int, int]]
    counts: list[list[int]]


class _Evaluator:
    """Runs Algorithm 2 at candidate shard sizes, caching each result."""

    def __init__(
        self, tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor], c: float, layout: str
    ) -> None:
        self.tensor_sizes = tensor_sizes
        self.neighbors = neighbors
        self.c = c
        self.layout = layout
        self.cache: dict[int, Evaluated] = {}

    def __call__(self, shard_size: int) -> Evaluated:
        hit = self.cache.get(shard_size)
        if hit is None:
            classes = shard_classes(self.tensor_sizes, shard_size, self.layout)
            counts, span = greedy_counts(classes, self.neighbors, self.c)
            hit = Evaluated(shard_size, span, classes, counts)
            self.cache[shard_size] = hit
        return hit

    def best(self) -> Evaluated:
        """The best evaluated size; ties go to the larger shard (fewer messages)."""
        return min(self.cache.values(), key=lambda e: (e.makespan_s, -e.shard_size))

    def assignment(self, ev: Evaluated) -> dict[str, list[tuple[int, int]]]:
        shards = cut_shards(self.tensor_sizes, ev.shard_size, self.layout)
        return realize(shards, ev.classes, ev.counts, self.neighbors)


def _bisect(f: Callable[[int], float], lo: int, hi: int) -> int:
    """Binary search for the minimum of a quasi-unimodal ``f`` over indices ``lo..hi``.

    Each step compares ``f`` at the midpoint with ``f`` one stride further. The stride is an
    eighth of the interval, so the comparison reads the trend of theta(s), not the rounding noise
    between neighbouring candidates; the interval halves until it is a few candidates wide.
    """
    while hi - lo > 3:
        mid = (lo + hi) // 2
        stride = max(1, (hi - lo) // 8)
        if f(mid) <= f(min(hi, mid + stride)):
            hi = min(hi, mid + stride)
        else:
            lo = mid + 1
    return min(range(lo, hi + 1), key=f)


def chaos_search(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
    min_shard_bytes: int,
) -> tuple[Evaluated, dict[str, list[tuple[int, int]]], int]:
    """Algorithm 1: binary search over the candidate shard sizes, Algorithm 2 at each step.

    After the search settles, Algorithm 2 also runs on ``REFINE_WINDOW`` candidates on each side
    of it, because theta(s) is only quasi-monotonic: rounding makes it jagged between
    neighbouring sizes.

    Returns:
        ``(best, assignment, evaluations)``.
    """
    cands = candidate_shard_sizes(tensor_sizes, layout, min_shard_bytes)
    ev = _Evaluator(tensor_sizes, neighbors, per_shard_cost_s, layout)
    i = _bisect(lambda j: ev(cands[j]).makespan_s, 0, len(cands) - 1)
    for j in range(max(0, i - REFINE_WINDOW), min(len(cands), i + REFINE_WINDOW + 1)):
        ev(cands[j])
    best = ev.best()
    return best, ev.assignment(best), len(ev.cache)


def scan_search(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
    min_shard_bytes: int,
) -> tuple[Evaluated, dict[str, list[tuple[int, int]]], int]:
    """Algorithm 2 at every candidate shard size, keeping the best. Measures what Alg. 1 misses."""
    cands = candidate_shard_sizes(tensor_sizes, layout, min_shard_bytes)
    ev = _Evaluator(tensor_sizes, neighbors, per_shard_cost_s, layout)
    for s in cands:
        ev(s)
    best = ev.best()
    return best, ev.assignment(best), len(ev.cache)


def fixed_search(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
    shard_size: int,
) -> tuple[Evaluated, dict[str, list[tuple[int, int]]], int]:
    """Algorithm 2 at one given shard size."""
    ev = _Evaluator(tensor_sizes, neighbors, per_shard_cost_s, layout)
    best = ev(shard_size)
    return best, ev.assignment(best), 1


def even_split(
    tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor], layout: str
) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    """Baseline ``"even"``: every neighbour sends the same number of bytes, ignoring its speed.

    Flat: one shard of ``ceil(|w| / |U|)`` bytes per neighbour. Per-tensor: shards of that size
    cut per tensor, each dealt to the neighbour with the fewest bytes so far.

    Returns:
        ``(shard_size, assignment)``.
    """
    total = sum(tensor_sizes)
    shard_size = max(1, math.ceil(total / len(neighbors)))
    shards = cut_shards(tensor_sizes, shard_size, layout)
    out: dict[str, list[tuple[int, int]]] = {n.id: [] for n in neighbors}
    sent = [0] * len(neighbors)
    for shard in sorted(shards, key=lambda r: -r[1]):
        u = min(range(len(neighbors)), key=lambda k: (sent[k], k))
        out[neighbors[u].id].append(shard)
        sent[u] += shard[1]
    for ranges in out.values():
        ranges.sort()
    return shard_size, out


def single_source(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    """Baseline ``"single-source"`` (EDL+): the neighbour that finishes the whole state first sends
    all of it, as one shard (flat) or one shard per tensor (per-tensor).

    Returns:
        ``(shard_size, assignment)``.
    """
    total = sum(tensor_sizes)
    shard_size = total if layout == "flat" else max(tensor_sizes)
    shards = cut_shards(tensor_sizes, shard_size, layout)
    fastest = min(
        neighbors,
        key=lambda n: n.finish_s(len(shards), total, per_shard_cost_s),
    )
    return shard_size, {n.id: (list(shards) if n is fastest else []) for n in neighbors}
