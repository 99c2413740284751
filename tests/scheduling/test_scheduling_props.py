"""Property tests (hypothesis) for chaos.scheduling's heuristics, bounds and greedy internals.

The MILP's properties live in ``test_scheduling_milp.py``; this file needs no solver.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from unittest import mock

import pytest
from chaos.scheduling import (
    LAYOUTS,
    Neighbor,
    Plan,
    candidate_shard_sizes,
    cut_shards,
    greedy,
    lower_bound,
    makespan,
    plan_replication,
    shard_lower_bound,
    water_level,
)
from chaos.scheduling.greedy import greedy_counts, greedy_reference, take_earliest
from chaos.scheduling.layout import shard_classes
from hypothesis import assume, given, settings
from hypothesis import strategies as st

HEURISTICS = ("chaos", "scan", "even", "single-source")
REL = 1e-9

costs_s = st.sampled_from([0.0, 1e-5, 5e-4, 2e-3, 0.05])
layouts = st.sampled_from(LAYOUTS)


@st.composite
def neighbor_lists(draw: st.DrawFn, max_size: int = 8) -> list[Neighbor]:
    """Neighbours in the paper's ranges; repeated values make ties (identical links) common."""
    k = draw(st.integers(1, max_size))
    out = []
    for i in range(k):
        bw = draw(st.one_of(st.sampled_from([100e6, 250e6, 1e9]), st.floats(100e6, 1e9)))
        prop = draw(st.one_of(st.sampled_from([0.0, 0.01]), st.floats(0.001, 0.05)))
        sync = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5)))
        out.append(Neighbor.from_bandwidth(f"n{i}", bw, prop_s=prop, sync_s=sync))
    return out


tensor_size_lists = st.lists(
    st.one_of(st.integers(0, 64), st.integers(0, 300_000)), min_size=1, max_size=8
).filter(lambda sizes: sum(sizes) > 0)


def assert_covers(plan: Plan, tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor]) -> None:
    assert set(plan.assignment) == {n.id for n in neighbors}
    ranges = sorted(r for rs in plan.assignment.values() for r in rs)
    pos = 0
    for off, length in ranges:
        assert length > 0
        assert off == pos, f"gap or overlap at byte {pos}"
        pos += length
    assert pos == sum(tensor_sizes)


def assert_layout(plan: Plan, tensor_sizes: Sequence[int]) -> None:
    """The shards are exactly the layout's cut of the state at the plan's shard size."""
    ranges = sorted(r for rs in plan.assignment.values() for r in rs)
    assert ranges == cut_shards(tensor_sizes, plan.shard_size, plan.layout)
    assert all(length <= plan.shard_size for _, length in ranges)


# --------------------------------------------------------------------------- plans


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", HEURISTICS)
@settings(max_examples=40)
@given(
    sizes=tensor_size_lists, ns=neighbor_lists(), c=costs_s, min_shard=st.sampled_from([1, 4096])
)
def test_plan_is_disjoint_cover_with_model_makespan(
    method: str, layout: str, sizes: list[int], ns: list[Neighbor], c: float, min_shard: int
) -> None:
    assume(min_shard > 1 or sum(sizes) < 50_000)  # keep the 1-byte candidate list short
    plan = plan_replication(sizes, ns, c, layout, method, min_shard_bytes=min_shard)
    assert_covers(plan, sizes, ns)
    assert_layout(plan, sizes)
    assert plan.makespan_s == makespan(plan.assignment, ns, c)
    assert plan.makespan_s == max(plan.finish_times(ns).values())
    assert plan.makespan_s >= lower_bound(sum(sizes), ns) * (1 - REL)
    assert plan.makespan_s >= shard_lower_bound(sum(sizes), ns, c, plan.shard_size) * (1 - REL)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=40)
@given(sizes=tensor_size_lists, ns=neighbor_lists(), c=costs_s, s=st.integers(1, 400_000))
def test_fixed_shard_size_plan(
    layout: str, sizes: list[int], ns: list[Neighbor], c: float, s: int
) -> None:
    assume(sum(sizes) // s <= 5_000)
    plan = plan_replication(sizes, ns, c, layout, "chaos", shard_size=s)
    assert plan.shard_size == s
    assert_covers(plan, sizes, ns)
    assert_layout(plan, sizes)
    assert plan.makespan_s == makespan(plan.assignment, ns, c)
    assert plan.makespan_s >= shard_lower_bound(sum(sizes), ns, c, s) * (1 - REL)
    if s in candidate_shard_sizes(sizes, layout):  # the scan tries s among others
        assert plan_replication(sizes, ns, c, layout, "scan").makespan_s <= plan.makespan_s


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=50)
@given(sizes=tensor_size_lists, ns=neighbor_lists(), c=costs_s)
def test_scan_is_never_worse_than_chaos(
    layout: str, sizes: list[int], ns: list[Neighbor], c: float
) -> None:
    chaos = plan_replication(sizes, ns, c, layout, "chaos")
    scan = plan_replication(sizes, ns, c, layout, "scan")
    cands = candidate_shard_sizes(sizes, layout)
    assert chaos.shard_size in cands and scan.shard_size in cands
    assert scan.makespan_s <= chaos.makespan_s
    assert chaos.extra["evaluations"] <= scan.extra["evaluations"] == len(cands)


@settings(max_examples=60)
@given(sizes=tensor_size_lists, ns=neighbor_lists(max_size=4), c=costs_s)
def test_unused_slow_neighbour_changes_nothing(
    sizes: list[int], ns: list[Neighbor], c: float
) -> None:
    """A neighbour that could only start after the whole state is done is never used."""
    slow = Neighbor(id="late", prop_s=0.0, trans_s_per_byte=1e-9, sync_s=1e6)
    with_slow = plan_replication(sizes, [*ns, slow], c, "flat", "scan")
    without = plan_replication(sizes, ns, c, "flat", "scan")
    assert with_slow.assignment["late"] == []
    assert with_slow.makespan_s == without.makespan_s


# --------------------------------------------------------------------------- greedy


def _smallest_choice_margin(
    lengths: list[int], owners: list[int], ns: list[Neighbor], c: float
) -> float:
    """Replays Algorithm 2's choices: smallest gap from the chosen to another finish."""
    loads = [n.start_s for n in ns]
    margin = math.inf
    for length, u in zip(lengths, owners, strict=True):
        chosen = loads[u] + length * ns[u].trans_s_per_byte + c
        for v, n in enumerate(ns):
            # a neighbour in the same position (same load, same speed) is interchangeable
            if (loads[v], n.trans_s_per_byte) != (loads[u], ns[u].trans_s_per_byte):
                margin = min(margin, loads[v] + length * n.trans_s_per_byte + c - chosen)
        loads[u] += length * ns[u].trans_s_per_byte + c
    return margin


@settings(max_examples=150)
@given(
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    ns=neighbor_lists(max_size=6),
    c=costs_s,
    s=st.integers(1, 120),
    layout=layouts,
)
def test_fast_greedy_matches_the_per_shard_loop(
    sizes: list[int], ns: list[Neighbor], c: float, s: int, layout: str
) -> None:
    classes = shard_classes(sizes, s, layout)
    _, span = greedy_counts(classes, ns, c)
    # the literal Algorithm 2 over the same shards, largest first (the order greedy_counts uses)
    shards = sorted(cut_shards(sizes, s, layout), key=lambda r: -r[1])
    lengths = [length for _, length in shards]
    owners = greedy_reference(lengths, ns, c)
    # Algorithm 2 is defined only up to ties (two neighbours finishing a shard at the same
    # time); floating-point rounding breaks exact ties arbitrarily, and a different choice at a
    # tie can change later choices. Compare where every choice was clear.
    assume(_smallest_choice_margin(lengths, owners, ns, c) > 1e-9 * max(span, 1e-12))
    assignment: dict[str, list[tuple[int, int]]] = {n.id: [] for n in ns}
    for shard, u in zip(shards, owners, strict=True):
        assignment[ns[u].id].append(shard)
    assert span == pytest.approx(makespan(assignment, ns, c), rel=REL)


@settings(max_examples=150)
@given(
    loads=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8),
    data=st.data(),
    m=st.one_of(st.integers(0, 50), st.integers(0, 10**9)),
)
def test_take_earliest_picks_the_m_smallest_finishes(
    loads: list[float], data: st.DataObject, m: int
) -> None:
    costs = data.draw(
        st.lists(
            st.one_of(st.sampled_from([0.5, 1.0, 2.0]), st.floats(1e-6, 5.0)),
            min_size=len(loads),
            max_size=len(loads),
        )
    )
    counts = take_earliest(loads, costs, m)
    assert len(counts) == len(loads)
    assert all(k >= 0 for k in counts)
    assert sum(counts) == m
    # exactly the m smallest of the merged sequences loads[u] + k * costs[u], k >= 1:
    # the latest one taken is no later than the earliest one left
    taken = max((ld + k * b for ld, b, k in zip(loads, costs, counts, strict=True) if k), default=0)
    left = min(ld + (k + 1) * b for ld, b, k in zip(loads, costs, counts, strict=True))
    assert taken <= left * (1 + REL) + 1e-12
    if m <= 50:  # and the literal merge agrees on the latest finish
        heap = [(ld + b, u) for u, (ld, b) in enumerate(zip(loads, costs, strict=True))]
        heapq.heapify(heap)
        last = 0.0
        for _ in range(m):
            last, u = heapq.heappop(heap)
            heapq.heappush(heap, (last + costs[u], u))
        assert taken == pytest.approx(last, rel=REL, abs=1e-12)


@settings(max_examples=100)
@given(
    loads=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=6),
    data=st.data(),
    m=st.integers(1, 40),
    shift=st.floats(-3.0, 3.0),
)
def test_take_earliest_repairs_a_misplaced_level(
    loads: list[float], data: st.DataObject, m: int, shift: float
) -> None:
    """Rounding can put the water level a little off; the heap steps must still land on the m
    smallest finishes. Shift the level by whole shards to exercise both repairs."""
    costs = data.draw(st.lists(st.floats(0.01, 5.0), min_size=len(loads), max_size=len(loads)))
    exact = take_earliest(loads, costs, m)
    real = greedy.water_level

    def shifted(*args: object) -> float:
        return real(*args) + shift * max(costs)  # type: ignore[arg-type]

    with mock.patch.object(greedy, "water_level", side_effect=shifted):
        repaired = take_earliest(loads, costs, m)
    assert sum(repaired) == m
    finish = [ld + k * b for ld, b, k in zip(loads, costs, repaired, strict=True)]
    taken = max(f for f, k in zip(finish, repaired, strict=True) if k)
    left = min(f + b for f, b in zip(finish, costs, strict=True))
    assert taken <= left * (1 + REL)
    exact_taken = max(ld + k * b for ld, b, k in zip(loads, costs, exact, strict=True) if k)
    assert taken == pytest.approx(exact_taken, rel=REL)


# --------------------------------------------------------------------------- bounds


@settings(max_examples=200)
@given(
    starts=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=10),
    data=st.data(),
    amount=st.one_of(st.floats(0.0, 1e3), st.floats(0.0, 1e12)),
)
def test_water_level_solves_its_equation(
    starts: list[float], data: st.DataObject, amount: float
) -> None:
    rates = data.draw(st.lists(st.floats(1e-3, 1e9), min_size=len(starts), max_size=len(starts)))
    level = water_level(starts, rates, amount)
    # rounding: theta is known to an ulp, and each active source multiplies that by its rate
    ulp = 4.5e-16 * (abs(level) + max(starts))
    assert level >= min(starts) - ulp

    def delivered(theta: float) -> float:
        return sum(max(0.0, (theta - t) * r) for t, r in zip(starts, rates, strict=True))

    tol = 1e-9 * amount + sum(r for t, r in zip(starts, rates, strict=True) if t < level) * ulp
    assert abs(delivered(level) - amount) <= tol + 1e-12
    if amount > 0:  # a lower level delivers strictly less: the level is the smallest solution
        assert delivered(level - max(1e-6, abs(level) * 1e-6)) < amount


@settings(max_examples=100)
@given(state=st.integers(1, 10**10), ns=neighbor_lists())
def test_lower_bound_is_below_every_single_neighbour(state: int, ns: list[Neighbor]) -> None:
    lb = lower_bound(state, ns)
    alone = [n.start_s + state * n.trans_s_per_byte for n in ns]
    assert min(n.start_s for n in ns) < lb <= min(alone) * (1 + REL)
    # more neighbours never raise the bound; a fresh one that starts at once lowers it
    extra = Neighbor(id="extra", prop_s=0.0, trans_s_per_byte=ns[0].trans_s_per_byte)
    assert lower_bound(state, [*ns, extra]) < lb
