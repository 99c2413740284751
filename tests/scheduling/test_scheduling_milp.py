"""The MILP reference (PuLP/CBC) against the greedy, against itself in its two forms, and against
brute force.

Instances are small so that CBC proves optimality in well under a second each, and scaled so that
the makespans are O(1 s): CBC's tolerances are absolute (about 1e-7), so a makespan of
microseconds would make "optimal" meaningless. The model has no units of its own, so this loses
nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import pytest
from chaos.scheduling import (
    LAYOUTS,
    Neighbor,
    Plan,
    candidate_shard_sizes,
    cut_shards,
    lower_bound,
    makespan,
    milp,
    plan_replication,
    shard_lower_bound,
)
from chaos.scheduling.greedy import greedy_counts
from hypothesis import given, settings
from hypothesis import strategies as st

REL = 1e-6
"""Relative tolerance between two optima (CBC's own tolerances are far below this at O(1 s))."""

MILP_SETTINGS = settings(max_examples=20, deadline=None)

costs_s = st.sampled_from([0.0, 0.01, 0.05, 0.2])
layouts = st.sampled_from(LAYOUTS)


@st.composite
def small_neighbors(draw: st.DrawFn, max_size: int = 3) -> list[Neighbor]:
    """1..max_size neighbours with 1..100 ms per byte and starts up to 1 s."""
    k = draw(st.integers(1, max_size))
    out = []
    for i in range(k):
        trans = draw(st.one_of(st.sampled_from([0.01, 0.02, 0.05]), st.floats(1e-3, 0.1)))
        prop = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.2)))
        sync = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
        out.append(Neighbor(id=f"n{i}", prop_s=prop, trans_s_per_byte=trans, sync_s=sync))
    return out


@contextmanager
def milp_form(form: str) -> Iterator[None]:
    """Forces ``solve_fixed`` to use the binary or the count form whatever the instance size."""
    limit = 10**9 if form == "binary" else -1
    with mock.patch.object(milp, "BINARY_FORM_LIMIT", limit):
        yield


def assert_covers(plan: Plan, tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor]) -> None:
    assert set(plan.assignment) == {n.id for n in neighbors}
    ranges = sorted(r for rs in plan.assignment.values() for r in rs)
    assert ranges == cut_shards(tensor_sizes, plan.shard_size, plan.layout)
    pos = 0
    for off, length in ranges:
        assert off == pos and length > 0
        pos += length
    assert pos == sum(tensor_sizes)


def split(total: int, cuts: list[int]) -> list[int]:
    """Splits ``total`` bytes into tensors at the given cut points (flat layout ignores them)."""
    points = sorted({min(c, total) for c in cuts} | {0, total})
    return [b - a for a, b in zip(points, points[1:], strict=False)]


# --------------------------------------------------------------------------- greedy vs MILP


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=4),
    s=st.integers(1, 40),
    k=st.integers(1, 10),
    cuts=st.lists(st.integers(0, 400), max_size=3),
    c=costs_s,
)
def test_greedy_equals_binary_milp_for_equal_shards(
    ns: list[Neighbor], s: int, k: int, cuts: list[int], c: float
) -> None:
    """At a fixed s with every shard s bytes, Algorithm 2 is optimal (paper's x_uj form)."""
    sizes = split(s * k, cuts)
    assert k * len(ns) <= milp.BINARY_FORM_LIMIT
    res = milp.solve_fixed(sizes, ns, c, "flat", s)
    assert res.form == "binary"
    plan = plan_replication(sizes, ns, c, "flat", "milp", shard_size=s)
    greedy = plan_replication(sizes, ns, c, "flat", "chaos", shard_size=s)
    assert plan.proven_optimal is True and res.proven_optimal
    assert plan.shard_size == greedy.shard_size == s
    assert_covers(plan, sizes, ns)
    assert greedy.makespan_s == pytest.approx(plan.makespan_s, rel=REL)
    assert greedy.makespan_s == pytest.approx(res.makespan_s, rel=REL)


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=8),
    s=st.integers(1, 10_000),
    k=st.one_of(st.integers(1, 60), st.integers(1, 5_000)),
    c=costs_s,
)
def test_greedy_equals_count_milp_for_equal_shards(
    ns: list[Neighbor], s: int, k: int, c: float
) -> None:
    """The same with one integer per neighbour (the form used beyond the binary limit)."""
    sizes = [s * k]
    with milp_form("count"):
        res = milp.solve_fixed(sizes, ns, c, "flat", s)
        plan = plan_replication(sizes, ns, c, "flat", "milp", shard_size=s)
    assert res.form == "count"
    greedy = plan_replication(sizes, ns, c, "flat", "chaos", shard_size=s)
    assert plan.proven_optimal is True and res.proven_optimal
    assert_covers(plan, sizes, ns)
    assert greedy.makespan_s == pytest.approx(plan.makespan_s, rel=REL)
    assert greedy.makespan_s == pytest.approx(res.makespan_s, rel=REL)


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=3),
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    s=st.integers(1, 30),
    layout=layouts,
    c=costs_s,
)
def test_milp_is_never_worse_than_greedy_at_fixed_s(
    ns: list[Neighbor], sizes: list[int], s: int, layout: str, c: float
) -> None:
    """With unequal shards (per-tensor tails, the flat tail) the greedy may lose, never win."""
    if len(cut_shards(sizes, s, layout)) * len(ns) > 45:
        s = max(s, -(-sum(sizes) // 12))
    plan = plan_replication(sizes, ns, c, layout, "milp", shard_size=s)
    greedy = plan_replication(sizes, ns, c, layout, "chaos", shard_size=s)
    assert plan.proven_optimal is True
    assert_covers(plan, sizes, ns)
    assert plan.makespan_s == makespan(plan.assignment, ns, c)
    assert plan.makespan_s <= greedy.makespan_s * (1 + REL)
    assert plan.makespan_s >= shard_lower_bound(sum(sizes), ns, c, s) * (1 - REL)


# --------------------------------------------------------------------------- search over s


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=3),
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    layout=layouts,
    c=costs_s,
)
def test_milp_search_is_a_lower_bound_for_scan_and_chaos(
    ns: list[Neighbor], sizes: list[int], layout: str, c: float
) -> None:
    """Over the same candidate shard sizes, scan and chaos are at best the MILP optimum."""
    kw = {"min_shard_bytes": 1}
    opt = plan_replication(sizes, ns, c, layout, "milp", **kw)
    scan = plan_replication(sizes, ns, c, layout, "scan", **kw)
    chaos = plan_replication(sizes, ns, c, layout, "chaos", **kw)
    assert opt.proven_optimal is True
    assert_covers(opt, sizes, ns)
    assert opt.makespan_s == makespan(opt.assignment, ns, c)
    assert opt.makespan_s == max(opt.finish_times(ns).values())
    assert opt.makespan_s >= lower_bound(sum(sizes), ns) * (1 - REL)
    assert opt.shard_size in candidate_shard_sizes(sizes, layout, 1)
    assert scan.makespan_s >= opt.makespan_s * (1 - REL)
    assert chaos.makespan_s >= scan.makespan_s


@settings(max_examples=12, deadline=None)
@given(
    ns=small_neighbors(max_size=3),
    sizes=st.lists(st.integers(0, 10), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    layout=layouts,
    c=costs_s,
)
def test_milp_search_pruning_loses_nothing(
    ns: list[Neighbor], sizes: list[int], layout: str, c: float
) -> None:
    """The bound-pruned scan equals solving every candidate shard size."""
    cands = candidate_shard_sizes(sizes, layout, 1)
    every = [milp.solve_fixed(sizes, ns, c, layout, s) for s in cands]
    assert all(r.proven_optimal for r in every)
    res = milp.milp_search(sizes, ns, c, layout, 1)
    assert res.proven_optimal
    assert 1 <= res.solves <= len(cands)
    assert res.makespan_s == pytest.approx(min(r.makespan_s for r in every), rel=REL)


# --------------------------------------------------------------------------- the two forms


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=3),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    s=st.integers(2, 40),
    layout=layouts,
    c=costs_s,
)
def test_binary_and_count_forms_agree(
    ns: list[Neighbor], sizes: list[int], s: int, layout: str, c: float
) -> None:
    if len(cut_shards(sizes, s, layout)) * len(ns) > 45:
        s = max(s, -(-max(sizes) // 3), -(-sum(sizes) // 12))
    with milp_form("binary"):
        binary = milp.solve_fixed(sizes, ns, c, layout, s)
    with milp_form("count"):
        count = milp.solve_fixed(sizes, ns, c, layout, s)
    assert (binary.form, count.form) == ("binary", "count")
    assert binary.proven_optimal and count.proven_optimal
    assert binary.makespan_s == pytest.approx(count.makespan_s, rel=REL)
    for res in (binary, count):
        assert res.makespan_s == makespan(res.assignment, ns, c)
        ranges = sorted(r for rs in res.assignment.values() for r in rs)
        assert ranges == cut_shards(sizes, s, layout)


def test_form_follows_the_instance_size() -> None:
    ns = [Neighbor(id=f"n{i}", prop_s=0.1 * i, trans_s_per_byte=0.01 * (i + 1)) for i in range(2)]
    k = milp.BINARY_FORM_LIMIT // 2  # k shards * 2 neighbours binaries: the largest binary form
    small = milp.solve_fixed([10 * k], ns, 0.01, "flat", 10)
    large = milp.solve_fixed([10 * (k + 1)], ns, 0.01, "flat", 10)
    assert (small.form, large.form) == ("binary", "count")
    assert small.proven_optimal and large.proven_optimal
    for res, shards in ((small, k), (large, k + 1)):
        greedy = plan_replication([10 * shards], ns, 0.01, "flat", "chaos", shard_size=10)
        assert res.makespan_s == pytest.approx(greedy.makespan_s, rel=REL)


def test_unproven_binary_form_is_re_solved_in_count_form() -> None:
    """CBC's time limit is not something a test should hit; stand in for it by reporting the
    binary solve as unproven."""
    real = milp._binary_form

    def unproven(*args: object, **kwargs: object) -> tuple[dict[str, list[tuple[int, int]]], bool]:
        assignment, _ = real(*args, **kwargs)  # type: ignore[arg-type]
        return assignment, False

    ns = [Neighbor(id="a", prop_s=0.0, trans_s_per_byte=0.01), Neighbor("b", 0.3, 0.02)]
    with mock.patch.object(milp, "_binary_form", side_effect=unproven) as spy:
        res = milp.solve_fixed([95], ns, 0.01, "per-tensor", 10)
    assert spy.call_count == 1
    assert res.form == "binary+count"
    assert res.proven_optimal
    assert res.makespan_s == pytest.approx(milp.brute_force([10] * 9 + [5], ns, 0.01), rel=REL)


# --------------------------------------------------------------------------- brute force


@MILP_SETTINGS
@given(
    ns=small_neighbors(max_size=3),
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    s=st.integers(1, 20),
    layout=layouts,
    c=costs_s,
)
def test_brute_force_equals_the_milp(
    ns: list[Neighbor], sizes: list[int], s: int, layout: str, c: float
) -> None:
    shards = cut_shards(sizes, s, layout)
    if len(shards) > 7:  # grow s: at most 2 shards per tensor and 7 in all
        s = max(s, -(-max(sizes) // 2), -(-sum(sizes) // 7))
        shards = cut_shards(sizes, s, layout)
    assert len(shards) <= 7
    best = milp.brute_force([length for _, length in shards], ns, c)
    res = milp.solve_fixed(sizes, ns, c, layout, s)
    assert res.form == "binary"
    assert res.proven_optimal
    assert res.makespan_s == pytest.approx(best, rel=REL)
    with milp_form("count"):
        count = milp.solve_fixed(sizes, ns, c, layout, s)
    assert count.makespan_s == pytest.approx(best, rel=REL)


@settings(max_examples=200)
@given(ns=small_neighbors(max_size=3), length=st.integers(1, 50), k=st.integers(1, 7), c=costs_s)
def test_greedy_is_optimal_for_equal_shards_by_brute_force(
    ns: list[Neighbor], length: int, k: int, c: float
) -> None:
    """The claim in greedy.py, checked without a solver: no assignment of k equal shards beats
    the earliest-finish greedy."""
    _, span = greedy_counts([(length, k)], ns, c)
    assert span == pytest.approx(milp.brute_force([length] * k, ns, c), rel=1e-12)
