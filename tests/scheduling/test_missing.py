"""Planning a pull of only the ranges a joiner lacks (content-addressed joins)."""

from __future__ import annotations

import pytest
from chaos.scheduling import Neighbor, map_to_ranges, plan_missing


def _covered(assignment: dict[str, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for off, length in sorted(r for v in assignment.values() for r in v):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((off, length))
    return merged


def test_a_shard_across_two_ranges_is_cut_in_two() -> None:
    ranges = [(10, 5), (100, 5)]
    got = map_to_ranges({"a": [(0, 7)], "b": [(7, 3)]}, ranges)
    assert got == {"a": [(10, 5), (100, 2)], "b": [(102, 3)]}


def test_bad_ranges_and_shards_beyond_them_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        map_to_ranges({}, [(10, 5), (12, 5)])
    with pytest.raises(ValueError, match="length"):
        map_to_ranges({}, [(10, 0)])
    with pytest.raises(ValueError, match="beyond"):
        map_to_ranges({"a": [(0, 11)]}, [(0, 10)])


@pytest.mark.parametrize("method", ["chaos", "even", "single-source"])
def test_the_plan_covers_exactly_the_missing_ranges(method: str) -> None:
    ranges = [(0, 4096), (1 << 20, 300_000), (5 << 20, 77), (6 << 20, 1 << 20)]
    nbrs = [Neighbor("a", 0.001, 1e-8), Neighbor("b", 0.002, 2e-8), Neighbor("c", 0.0, 5e-9)]
    plan = plan_missing(ranges, nbrs, 4e-6, method)
    assert _covered(plan.assignment) == ranges
    assert plan.state_bytes == sum(n for _, n in ranges)
    assert plan.makespan_s > 0


def test_pulling_less_takes_less_time_in_the_model() -> None:
    nbrs = [Neighbor("a", 0.0, 1e-8), Neighbor("b", 0.0, 1e-8)]
    full = plan_missing([(0, 10 << 20)], nbrs, 4e-6)
    part = plan_missing([(0, 1 << 20), (5 << 20, 1 << 20)], nbrs, 4e-6)
    assert part.makespan_s < full.makespan_s / 3
