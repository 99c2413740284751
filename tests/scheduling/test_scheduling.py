"""Unit tests for chaos.scheduling: hand-checked plans for every method and layout, and bad input.

The numbers in the hand examples follow from the time model
``t_u = prop_u + sync_u + bytes_u * trans_u + n_u * c`` (0 for a neighbour that sends nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from chaos.scheduling import (
    LAYOUTS,
    METHODS,
    Neighbor,
    Plan,
    candidate_shard_sizes,
    cut_shards,
    finish_times,
    greedy,
    lower_bound,
    makespan,
    milp,
    plan_replication,
    shard_lower_bound,
    water_level,
)
from chaos.scheduling.layout import shard_classes

SEARCHING = ("chaos", "scan", "milp")
"""Methods that search the shard size and accept a fixed ``shard_size``."""


def nb(id: str, prop: float = 0.0, trans: float = 1e-3, sync: float = 0.0) -> Neighbor:
    return Neighbor(id=id, prop_s=prop, trans_s_per_byte=trans, sync_s=sync)


def ranges_of(plan: Plan) -> list[tuple[int, int]]:
    return sorted(r for rs in plan.assignment.values() for r in rs)


def assert_valid(plan: Plan, tensor_sizes: Sequence[int], neighbors: Sequence[Neighbor]) -> None:
    """The plan's ranges are disjoint, cover the state exactly, and its makespan is the model's."""
    total = sum(tensor_sizes)
    assert set(plan.assignment) == {n.id for n in neighbors}
    pos = 0
    for off, length in ranges_of(plan):
        assert length > 0, f"empty shard at {off}"
        assert off == pos, f"gap or overlap at byte {pos}: next range starts at {off}"
        pos += length
    assert pos == total
    assert plan.state_bytes == total
    assert plan.makespan_s == makespan(plan.assignment, neighbors, plan.per_shard_cost_s)
    assert plan.makespan_s == max(plan.finish_times(neighbors).values())


def bytes_sent(plan: Plan) -> dict[str, int]:
    return {nid: sum(length for _, length in rs) for nid, rs in plan.assignment.items()}


def tensor_spans(tensor_sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, base = [], 0
    for size in tensor_sizes:
        out.append((base, base + size))
        base += size
    return out


# --------------------------------------------------------------------------- hand-checked plans


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["chaos", "scan", "milp", "even"])
def test_two_identical_neighbours_split_evenly(method: str, layout: str) -> None:
    ns = [nb("a", prop=0.01), nb("b", prop=0.01)]
    sizes = [500, 500]
    plan = plan_replication(sizes, ns, 0.01, layout, method, min_shard_bytes=10)
    assert_valid(plan, sizes, ns)
    assert bytes_sent(plan) == {"a": 500, "b": 500}
    assert plan.shard_size == 500
    assert plan.num_shards == 2
    # 0.01 prop + 500 B * 1 ms/B + one shard * 10 ms
    assert plan.makespan_s == pytest.approx(0.52, rel=1e-12)
    assert plan.method == method
    assert plan.layout == layout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", SEARCHING)
def test_neighbour_with_huge_sync_gets_nothing(method: str, layout: str) -> None:
    ns = [nb("a"), nb("slow", sync=100.0), nb("b")]
    sizes = [400, 600]
    plan = plan_replication(sizes, ns, 0.001, layout, method, min_shard_bytes=10)
    assert_valid(plan, sizes, ns)
    assert plan.assignment["slow"] == []
    assert plan.finish_times(ns)["slow"] == 0.0
    assert plan.makespan_s < 1.0
    without = plan_replication(sizes, [ns[0], ns[2]], 0.001, layout, method, min_shard_bytes=10)
    assert plan.makespan_s == pytest.approx(without.makespan_s, rel=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_even_ignores_speed(layout: str) -> None:
    ns = [nb("a"), nb("slow", sync=100.0), nb("b")]
    plan = plan_replication([300, 600], ns, 0.0, layout, "even")
    assert_valid(plan, [300, 600], ns)
    assert bytes_sent(plan) == {"a": 300, "slow": 300, "b": 300}
    assert plan.shard_size == 300
    assert plan.makespan_s == pytest.approx(100.3, rel=1e-12)
    assert plan.proven_optimal is None


def test_even_flat_gives_one_shard_per_neighbour() -> None:
    ns = [nb(str(i)) for i in range(4)]
    plan = plan_replication([999, 1], ns, 0.0, "flat", "even")
    assert_valid(plan, [999, 1], ns)
    assert {nid: len(rs) for nid, rs in plan.assignment.items()} == dict.fromkeys("0123", 1)
    assert set(bytes_sent(plan).values()) == {250}


@pytest.mark.parametrize(
    ("state", "winner"),
    [
        # a: 1000 B * 1 ms/B = 1.0 s; b: 0.5 s sync + 1000 B * 0.1 ms/B = 0.6 s
        (1000, "b"),
        # a: 0.01 s; b: 0.501 s. The slower link wins when it can start at once.
        (10, "a"),
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_source_picks_earliest_finish(state: int, winner: str, layout: str) -> None:
    ns = [nb("a", trans=1e-3), nb("b", trans=1e-4, sync=0.5)]
    sizes = [state // 2, state - state // 2]
    plan = plan_replication(sizes, ns, 0.002, layout, "single-source")
    assert_valid(plan, sizes, ns)
    loser = "a" if winner == "b" else "b"
    assert plan.assignment[loser] == []
    assert bytes_sent(plan)[winner] == state
    if layout == "flat":
        assert plan.assignment[winner] == [(0, state)]
        assert plan.shard_size == state
    else:
        assert plan.assignment[winner] == [(0, sizes[0]), (sizes[0], sizes[1])]
        assert plan.shard_size == max(sizes)
    shards = 1 if layout == "flat" else 2
    by_id = {n.id: n for n in ns}
    assert plan.makespan_s == pytest.approx(by_id[winner].finish_s(shards, state, 0.002))


def test_single_source_pays_one_shard_cost_per_tensor() -> None:
    # 20 tensors of 50 B. a: 1000 B * 1 ms/B = 1.0 s; b: 1.0 s sync + 0.1 s = 1.1 s -> a.
    sizes = [50] * 20
    ns = [nb("a", trans=1e-3), nb("b", trans=1e-4, sync=1.0)]
    assert plan_replication(sizes, ns, 0.0, "per-tensor", "single-source").assignment["b"] == []
    # without b's sync, b needs 0.1 s; per-tensor it sends 20 shards at 10 ms each
    ns2 = [nb("a", trans=1e-3), nb("b", trans=1e-4)]
    plan = plan_replication(sizes, ns2, 0.01, "per-tensor", "single-source")
    assert plan.assignment["a"] == []
    assert plan.num_shards == 20
    assert plan.makespan_s == pytest.approx(0.1 + 20 * 0.01)
    flat = plan_replication(sizes, ns2, 0.01, "flat", "single-source")
    assert flat.makespan_s == pytest.approx(0.1 + 0.01)


FIXED_SIZES = [1000, 37, 1500, 0, 123]


@pytest.mark.parametrize("method", METHODS)
def test_per_tensor_shards_never_cross_a_tensor_boundary(method: str) -> None:
    ns = [nb("a", trans=1e-3), nb("b", trans=2e-3, prop=0.05), nb("c", trans=5e-4, sync=0.3)]
    kwargs = {"shard_size": 300} if method in SEARCHING else {}
    plan = plan_replication(FIXED_SIZES, ns, 0.001, "per-tensor", method, **kwargs)
    assert_valid(plan, FIXED_SIZES, ns)
    if method in SEARCHING:
        assert plan.shard_size == 300
    s = plan.shard_size
    assert ranges_of(plan) == cut_shards(FIXED_SIZES, s, "per-tensor")
    for lo, hi in tensor_spans(FIXED_SIZES):
        inside = [(o, n) for o, n in ranges_of(plan) if lo <= o < hi]
        for off, length in inside:
            assert off + length <= hi, f"shard {(off, length)} crosses the tensor end {hi}"
        # every shard of a tensor is s bytes except its last
        assert all(length == s for _, length in inside[:-1])
        assert sum(length for _, length in inside) == hi - lo


def test_per_tensor_cut_by_hand() -> None:
    assert cut_shards(FIXED_SIZES, 300, "per-tensor") == [
        (0, 300), (300, 300), (600, 300), (900, 100),
        (1000, 37),
        (1037, 300), (1337, 300), (1637, 300), (1937, 300), (2237, 300),
        (2537, 123),
    ]  # fmt: skip
    assert shard_classes(FIXED_SIZES, 300, "per-tensor") == [(300, 8), (123, 1), (100, 1), (37, 1)]


@pytest.mark.parametrize("method", SEARCHING)
def test_flat_shards_are_s_bytes_but_the_last(method: str) -> None:
    ns = [nb("a", trans=1e-3), nb("b", trans=2e-3, prop=0.05), nb("c", trans=5e-4, sync=0.3)]
    plan = plan_replication(FIXED_SIZES, ns, 0.001, "flat", method, shard_size=300)
    assert_valid(plan, FIXED_SIZES, ns)
    assert plan.shard_size == 300
    lengths = [length for _, length in ranges_of(plan)]
    assert lengths == [300] * 8 + [260]  # 2660 bytes = 8 * 300 + 260


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_a_valid_plan(method: str, layout: str) -> None:
    ns = [
        Neighbor.from_bandwidth("a", 100e6, prop_s=0.010, sync_s=0.0),
        Neighbor.from_bandwidth("b", 1e9, prop_s=0.002, sync_s=0.3),
        Neighbor.from_bandwidth("c", 400e6, prop_s=0.040, sync_s=0.05),
    ]
    sizes = [4096, 70_000, 64, 0, 30_000]
    plan = plan_replication(sizes, ns, 5e-4, layout, method, min_shard_bytes=2048)
    assert_valid(plan, sizes, ns)
    assert plan.method == method and plan.layout == layout
    assert plan.per_shard_cost_s == 5e-4
    assert plan.makespan_s >= lower_bound(sum(sizes), ns)
    assert plan.makespan_s >= shard_lower_bound(sum(sizes), ns, 5e-4, plan.shard_size) * (1 - 1e-12)
    assert ranges_of(plan) == cut_shards(sizes, plan.shard_size, layout)
    if method == "milp":
        assert plan.proven_optimal is True
        assert plan.extra["solves"] >= 1
    else:
        assert plan.proven_optimal is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_methods_rank_as_expected(layout: str) -> None:
    ns = [
        Neighbor.from_bandwidth("a", 100e6, prop_s=0.010, sync_s=0.0),
        Neighbor.from_bandwidth("b", 1e9, prop_s=0.002, sync_s=0.3),
        Neighbor.from_bandwidth("c", 400e6, prop_s=0.040, sync_s=0.05),
    ]
    sizes = [4096, 70_000_000, 64, 30_000_000]
    theta = {
        m: plan_replication(sizes, ns, 5e-4, layout, m).makespan_s
        for m in ("chaos", "scan", "even", "single-source")
    }
    assert theta["scan"] <= theta["chaos"]
    assert theta["chaos"] < theta["even"]
    assert theta["chaos"] < theta["single-source"]
    assert theta["chaos"] <= theta["scan"] * 1.01


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_one_byte_tensors(method: str, layout: str) -> None:
    # Regression: with a 1-byte span the candidate list never fell below 1 byte and the
    # shard-count loop ran until it overflowed.
    ns = [nb("a"), nb("b", trans=2e-3)]
    one = plan_replication([1], ns, 0.0, layout, method)
    assert_valid(one, [1], ns)
    assert one.assignment["a"] == [(0, 1)]
    three = plan_replication([1, 1, 1], ns, 0.0, layout, method, min_shard_bytes=1)
    assert_valid(three, [1, 1, 1], ns)
    if method in SEARCHING:  # a sends two 1-byte shards (2 ms), b one (2 ms)
        assert three.makespan_s == pytest.approx(0.002)
        assert bytes_sent(three) == {"a": 2, "b": 1}


def test_fixed_shard_size_is_used_by_the_greedy() -> None:
    ns = [nb("a"), nb("b", trans=2e-3)]
    plan = plan_replication([90], ns, 0.0, "flat", "chaos", shard_size=10)
    # 9 shards of 10 B: a costs 10 ms each, b 20 ms each -> a takes 6 (60 ms), b 3 (60 ms).
    assert plan.shard_size == 10
    assert bytes_sent(plan) == {"a": 60, "b": 30}
    assert plan.makespan_s == pytest.approx(0.06)
    assert plan.extra["evaluations"] == 1.0


def test_shard_size_larger_than_the_state_is_one_shard() -> None:
    ns = [nb("a"), nb("b", trans=2e-3)]
    plan = plan_replication([90], ns, 0.0, "flat", "scan", shard_size=10_000)
    assert ranges_of(plan) == [(0, 90)]
    assert plan.assignment["a"] == [(0, 90)]


def test_scan_evaluates_every_candidate_and_chaos_fewer() -> None:
    ns = [Neighbor.from_bandwidth(f"n{i}", (i + 1) * 100e6, prop_s=0.01 * i) for i in range(8)]
    sizes = [1_000_000_000]
    cands = candidate_shard_sizes(sizes, "flat")
    scan = plan_replication(sizes, ns, 5e-4, "flat", "scan")
    chaos = plan_replication(sizes, ns, 5e-4, "flat", "chaos")
    assert scan.extra["evaluations"] == len(cands)
    assert chaos.extra["evaluations"] < len(cands) / 4
    assert scan.shard_size in cands and chaos.shard_size in cands
    assert scan.makespan_s <= chaos.makespan_s


def test_per_shard_cost_favours_fewer_shards() -> None:
    ns = [nb(f"n{i}", trans=1e-6 * (i + 1)) for i in range(4)]
    sizes = [1_000_000]
    cheap = plan_replication(sizes, ns, 0.0, "flat", "scan")
    dear = plan_replication(sizes, ns, 0.05, "flat", "scan")
    assert dear.num_shards < cheap.num_shards
    assert dear.shard_size > cheap.shard_size


def test_milp_reports_solves_and_beats_or_ties_scan() -> None:
    ns = [nb("a", trans=1e-3), nb("b", trans=3e-3, prop=0.02), nb("c", trans=2e-3, sync=0.1)]
    sizes = [40, 25]
    for layout in LAYOUTS:
        m = plan_replication(sizes, ns, 0.003, layout, "milp", min_shard_bytes=4)
        s = plan_replication(sizes, ns, 0.003, layout, "scan", min_shard_bytes=4)
        assert m.proven_optimal is True
        assert 1 <= m.extra["solves"] <= len(candidate_shard_sizes(sizes, layout, 4))
        assert m.makespan_s <= s.makespan_s * (1 + 1e-9)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_milp_budget_returns_the_best_so_far(layout: str) -> None:
    # Regression: a budget spent before the first solve (here: at once) raised SolverError.
    ns = [nb("a", trans=1e-3), nb("b", trans=3e-3, prop=0.02), nb("c", trans=2e-3, sync=0.1)]
    sizes = [40, 25]
    full = plan_replication(sizes, ns, 0.003, layout, "milp", min_shard_bytes=4)
    cut = plan_replication(
        sizes, ns, 0.003, layout, "milp", min_shard_bytes=4, total_time_limit_s=0.0
    )
    assert_valid(cut, sizes, ns)
    assert cut.extra["solves"] == 1.0
    assert cut.makespan_s >= full.makespan_s * (1 - 1e-9)
    # proven only if the bounds prune every other candidate after the first solve
    assert cut.proven_optimal is (full.extra["solves"] == 1.0)
    if layout == "per-tensor":  # this instance needs a second solve there
        assert full.extra["solves"] > 1 and cut.proven_optimal is False


def test_milp_with_fixed_shard_size() -> None:
    ns = [nb("a"), nb("b", trans=2e-3)]
    plan = plan_replication([90], ns, 0.0, "flat", "milp", shard_size=10)
    assert plan.shard_size == 10
    assert plan.proven_optimal is True
    assert plan.extra["solves"] == 1.0
    assert plan.makespan_s == pytest.approx(0.06, rel=1e-9)


# --------------------------------------------------------------------------- bounds


def test_water_level_by_hand() -> None:
    assert water_level([0.0], [2.0], 10.0) == pytest.approx(5.0)
    # (7 - 0) * 1 + (7 - 4) * 1 = 10
    assert water_level([0.0, 4.0], [1.0, 1.0], 10.0) == pytest.approx(7.0)
    # the third source starts after the level is reached and adds nothing
    assert water_level([0.0, 100.0, 4.0], [1.0, 1.0, 1.0], 10.0) == pytest.approx(7.0)
    # (t - 1) * 3 = 6 -> t = 3 is below the second start (5)
    assert water_level([1.0, 5.0], [3.0, 10.0], 6.0) == pytest.approx(3.0)
    # nothing to deliver: the level is the earliest start
    assert water_level([3.0, 1.0], [1.0, 1.0], 0.0) == 1.0


def test_lower_bound_by_hand() -> None:
    ns = [nb("a", prop=0.01), nb("b", prop=0.01)]
    assert lower_bound(1000, ns) == pytest.approx(0.51)
    # with c = 10 ms and shards of at most 500 B each byte costs 1 ms + 10 ms / 500
    assert shard_lower_bound(1000, ns, 0.01, 500) == pytest.approx(0.52)
    ns3 = [*ns, nb("late", sync=50.0)]
    assert lower_bound(1000, ns3) == pytest.approx(0.51)


@pytest.mark.parametrize(
    ("starts", "rates", "amount", "match"),
    [
        ([], [], 1.0, "at least one source"),
        ([0.0, 1.0], [1.0], 1.0, "one rate per start"),
        ([0.0], [1.0], -1.0, "amount must be >= 0"),
        ([0.0, 1.0], [1.0, 0.0], 1.0, "rate must be > 0"),
        ([0.0], [-2.0], 1.0, "rate must be > 0"),
    ],
)
def test_water_level_rejects_bad_input(
    starts: list[float], rates: list[float], amount: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        water_level(starts, rates, amount)


# --------------------------------------------------------------------------- model


def test_neighbor_from_bandwidth() -> None:
    n = Neighbor.from_bandwidth("b", 200e6, prop_s=0.01, sync_s=0.05)
    assert n.trans_s_per_byte == pytest.approx(8 / 200e6)
    assert n.start_s == pytest.approx(0.06)
    assert n.finish_s(0, 0, 1.0) == 0.0
    assert n.finish_s(2, 1000, 0.5) == pytest.approx(0.06 + 1000 * 4e-8 + 1.0)


def test_finish_times_and_makespan_by_hand() -> None:
    ns = [nb("a", prop=0.1), nb("b", trans=2e-3, sync=0.2), nb("idle", sync=5.0)]
    asg = {"a": [(0, 100), (300, 50)], "b": [(100, 200)]}
    t = finish_times(asg, ns, 0.01)
    assert t == pytest.approx({"a": 0.1 + 0.15 + 0.02, "b": 0.2 + 0.4 + 0.01, "idle": 0.0})
    assert makespan(asg, ns, 0.01) == pytest.approx(0.61)
    assert makespan({}, ns, 0.01) == 0.0
    with pytest.raises(ValueError, match=r"unknown neighbours: \['ghost'\]"):
        finish_times({"ghost": [(0, 1)]}, ns, 0.0)


def test_plan_properties() -> None:
    ns = [nb("a"), nb("b")]
    plan = Plan("chaos", "flat", 10, {"a": [(0, 10), (10, 5)], "b": []}, 0.025, 15, 0.01)
    assert plan.num_shards == 2
    assert plan.finish_times(ns) == pytest.approx({"a": 0.015 + 0.02, "b": 0.0})


# --------------------------------------------------------------------------- layout


def test_cut_shards_flat() -> None:
    assert cut_shards([5, 0, 6], 4, "flat") == [(0, 4), (4, 4), (8, 3)]
    assert cut_shards([5, 0, 6], 4, "per-tensor") == [(0, 4), (4, 1), (5, 4), (9, 2)]
    assert shard_classes([5, 0, 6], 4, "flat") == [(4, 2), (3, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_candidate_shard_sizes(layout: str) -> None:
    sizes = [300_000, 1_000_000, 5]
    span = sum(sizes) if layout == "flat" else max(sizes)
    cands = candidate_shard_sizes(sizes, layout, 1024)
    assert cands == sorted(set(cands))
    assert cands[-1] == span
    assert cands[0] >= 1024
    for k in range(1, 257):  # every shard count up to 256 has its size
        assert -(-span // k) in cands
    assert candidate_shard_sizes([100], layout, 1024) == [100]
    assert candidate_shard_sizes([6], layout, 1) == [1, 2, 3, 6]


def test_candidate_shard_sizes_geometric_tail() -> None:
    cands = candidate_shard_sizes([10**9], "flat", 1024)
    assert 256 < len(cands) < 256 + 1000
    assert cands[0] >= 1024 and cands[0] < 1024 * 1.02


# --------------------------------------------------------------------------- greedy internals


def test_take_earliest_by_hand() -> None:
    # merged finishes: a 1, 2, 3, ...; b 2, 4, ... -> the 3 smallest are 1, 2, 2
    assert greedy.take_earliest([0.0, 0.0], [1.0, 2.0], 3) == [2, 1]
    assert greedy.take_earliest([0.0, 0.0], [1.0, 2.0], 0) == [0, 0]
    # b starts after every shard a would take: it gets none
    assert greedy.take_earliest([0.0, 100.0], [1.0, 1.0], 50) == [50, 0]


def test_greedy_reference_by_hand() -> None:
    ns = [nb("a", trans=1.0), nb("b", trans=2.0)]
    # shard 1: a 5 vs b 10 -> a; shard 2: a 10 vs b 10 -> tie to the first, a; shard 3: b
    assert greedy.greedy_reference([5, 5, 5], ns, 0.0) == [0, 0, 1]


def test_greedy_counts_by_hand() -> None:
    ns = [nb("a", trans=1.0), nb("b", trans=2.0)]
    counts, span = greedy.greedy_counts([(5, 3)], ns, 0.0)
    assert counts == [[2, 1]]
    assert span == pytest.approx(10.0)
    assert greedy.greedy_counts([], ns, 0.0) == ([], 0.0)


def test_realize_rejects_mismatched_counts() -> None:
    ns = [nb("a"), nb("b")]
    shards = cut_shards([30], 10, "flat")
    assert greedy.realize(shards, [(10, 3)], [[2, 1]], ns) == {
        "a": [(0, 10), (10, 10)],
        "b": [(20, 10)],
    }
    with pytest.raises(ValueError, match="shard counts do not match"):
        greedy.realize(shards, [(10, 3)], [[2, 2]], ns)


def test_brute_force_by_hand() -> None:
    ns = [nb("a", trans=1.0), nb("b", trans=1.0, sync=3.0)]
    # [4, 2, 2]: a alone 8; a {4} + b {2, 2} = max(4, 7); a {4, 2} + b {2} = max(6, 5) = 6
    assert milp.brute_force([4, 2, 2], ns, 0.0) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="brute force is limited"):
        milp.brute_force([1] * 21, ns, 0.0)


# --------------------------------------------------------------------------- bad input

GOOD = [nb("a"), nb("b")]


@pytest.mark.parametrize("method", METHODS)
def test_no_neighbours(method: str) -> None:
    with pytest.raises(ValueError, match="no neighbours"):
        plan_replication([100], [], 0.0, "flat", method)


@pytest.mark.parametrize("trans", [0.0, -1e-9, -1.0])
def test_non_positive_bandwidth_neighbor(trans: float) -> None:
    with pytest.raises(ValueError, match="non-positive bandwidth"):
        Neighbor(id="a", prop_s=0.0, trans_s_per_byte=trans)


@pytest.mark.parametrize("bandwidth", [0.0, 0, -100e6, math.nan, math.inf, -math.inf])
def test_from_bandwidth_rejects_non_positive(bandwidth: float) -> None:
    with pytest.raises(ValueError, match=r"'a': bandwidth must be > 0 bit/s"):
        Neighbor.from_bandwidth("a", bandwidth, prop_s=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prop_s": -0.1}, r"'a' prop_s must be >= 0"),
        ({"prop_s": math.nan}, r"'a' prop_s must be finite"),
        ({"sync_s": -1.0}, r"'a' sync_s must be >= 0"),
        ({"sync_s": math.inf}, r"'a' sync_s must be finite"),
        ({"trans_s_per_byte": math.nan}, r"trans_s_per_byte .* must be finite"),
        ({"id": ""}, "id must be a non-empty string"),
    ],
)
def test_neighbor_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"id": "a", "prop_s": 0.0, "trans_s_per_byte": 1e-3, "sync_s": 0.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Neighbor(**args)  # type: ignore[arg-type]


def test_neighbor_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="prop_s must be a number of seconds"):
        Neighbor(id="a", prop_s="0.1", trans_s_per_byte=1e-3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bandwidth_bps must be a number"):
        Neighbor.from_bandwidth("a", "1e9", prop_s=0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_negative_size(method: str, layout: str) -> None:
    with pytest.raises(ValueError, match=r"tensor_sizes\[1\] is negative \(-5 bytes\)"):
        plan_replication([10, -5, 20], GOOD, 0.0, layout, method)


@pytest.mark.parametrize("size", [1.5, "10", True, None])
def test_non_int_size(size: object) -> None:
    with pytest.raises(ValueError, match=r"tensor_sizes\[0\] must be an int"):
        plan_replication([size], GOOD, 0.0)  # type: ignore[list-item]


@pytest.mark.parametrize("sizes", [[], [0], [0, 0, 0]])
@pytest.mark.parametrize("method", METHODS)
def test_empty_state(sizes: list[int], method: str) -> None:
    with pytest.raises(ValueError, match="empty state"):
        plan_replication(sizes, GOOD, 0.0, "per-tensor", method)


@pytest.mark.parametrize("method", METHODS)
def test_duplicate_ids(method: str) -> None:
    ns = [nb("a"), nb("b"), nb("a", trans=5e-3)]
    with pytest.raises(ValueError, match=r"duplicate neighbour ids: \['a'\]"):
        plan_replication([100], ns, 0.0, "flat", method)


@pytest.mark.parametrize("method", ["greedy", "", "CHAOS", "milp "])
def test_unknown_method(method: str) -> None:
    with pytest.raises(ValueError, match=f"unknown method {method!r}"):
        plan_replication([100], GOOD, 0.0, "flat", method)


@pytest.mark.parametrize("layout", ["", "tensor", "Flat", "per_tensor"])
@pytest.mark.parametrize("method", METHODS)
def test_unknown_layout(layout: str, method: str) -> None:
    with pytest.raises(ValueError, match=f"unknown layout {layout!r}"):
        plan_replication([100], GOOD, 0.0, layout, method)


@pytest.mark.parametrize("shard_size", [0, -1, 2.5, True, "64"])
@pytest.mark.parametrize("method", METHODS)
def test_bad_shard_size(shard_size: object, method: str) -> None:
    with pytest.raises(ValueError, match="shard size must be a positive int"):
        plan_replication([100], GOOD, 0.0, "flat", method, shard_size=shard_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("min_shard_bytes", [0, -4, 1.0])
def test_bad_min_shard_bytes(min_shard_bytes: object) -> None:
    with pytest.raises(ValueError, match="shard size must be a positive int"):
        plan_replication([100], GOOD, 0.0, min_shard_bytes=min_shard_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("cost", [-1e-9, -0.5, math.nan, math.inf])
@pytest.mark.parametrize("method", METHODS)
def test_bad_per_shard_cost(cost: float, method: str) -> None:
    with pytest.raises(ValueError, match="per_shard_cost_s must be finite and >= 0"):
        plan_replication([100], GOOD, cost, "flat", method)


def test_wrong_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="Neighbor instances"):
        plan_replication([100], [nb("a"), ("b", 0.0, 1e-3)], 0.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="per_shard_cost_s must be a number"):
        plan_replication([100], GOOD, "0.1")  # type: ignore[arg-type]


def test_numpy_integer_sizes_are_accepted() -> None:
    import numpy as np

    ns = [nb("a", trans=1e-3), nb("b", trans=2e-3)]
    plan = plan_replication([np.int64(100), np.int32(50)], ns, 0.001, "flat", "chaos")
    assert_valid(plan, [100, 50], ns)


@pytest.mark.parametrize("bad", [1.5, "10", None])
def test_non_integer_size_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="must be an int"):
        plan_replication([10, bad], [nb("a", trans=1e-3)], 0.001)  # type: ignore[list-item]


@pytest.mark.parametrize("method", ["even", "single-source"])
def test_shard_size_with_a_baseline_is_refused(method: str) -> None:
    with pytest.raises(ValueError, match="shard_size applies"):
        plan_replication([100], [nb("a", trans=1e-3)], 0.001, "flat", method, shard_size=10)


@pytest.mark.parametrize(
    "kwargs", [{"time_limit_s": 0.0}, {"time_limit_s": float("nan")}, {"total_time_limit_s": -1.0}]
)
def test_bad_time_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="time_limit_s"):
        plan_replication([100], [nb("a", trans=1e-3)], 0.001, "flat", "milp", **kwargs)
