"""The global batch's split by throughput: exact integer sums, at least one sample each,
proportional within one sample, stable under small throughput noise, and the splitter's
re-split rule (membership changes always, drift beyond the tolerance at most every interval)."""

from __future__ import annotations

import math

import pytest
from chaos.daemon.scheduler.batch_split import BatchSplitter, ideal_shares, split_batch
from hypothesis import given
from hypothesis import strategies as st

_rates = st.floats(min_value=0.01, max_value=1e6, allow_nan=False, allow_infinity=False)
_members = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), _rates, min_size=1,
                           max_size=12)  # fmt: skip


@given(_members, st.integers(min_value=0, max_value=100_000))
def test_sizes_sum_to_the_global_batch_each_at_least_one(
    rates: dict[str, float], more: int
) -> None:
    global_batch = len(rates) + more
    sizes = split_batch(global_batch, rates, rates)
    assert sorted(sizes) == sorted(rates)
    assert sum(sizes.values()) == global_batch
    assert all(isinstance(v, int) and v >= 1 for v in sizes.values())


@given(_members, st.integers(min_value=0, max_value=100_000))
def test_sizes_are_within_one_sample_of_the_proportional_share(
    rates: dict[str, float], more: int
) -> None:
    global_batch = len(rates) + more
    shares = ideal_shares(global_batch, rates, rates)
    sizes = split_batch(global_batch, rates, rates)
    for m, size in sizes.items():
        if shares[m] >= 1.0:
            assert math.floor(shares[m]) - 1 <= size <= math.ceil(shares[m]) + 1
            assert abs(size - shares[m]) < 2.0
        else:
            assert size >= 1


def test_a_five_times_slower_member_gets_a_fifth() -> None:
    sizes = split_batch(
        64, ["a", "b", "c", "slow"], {"a": 50.0, "b": 50.0, "c": 50.0, "slow": 10.0}
    )
    assert sizes == {"a": 20, "b": 20, "c": 20, "slow": 4}


def test_unmeasured_members_weigh_as_the_mean_of_the_measured() -> None:
    sizes = split_batch(30, ["a", "b", "new"], {"a": 10.0, "b": 20.0})
    assert sizes == {"a": 7, "b": 13, "new": 10}
    assert split_batch(10, ["x", "y"], {}) == {"x": 5, "y": 5}
    assert split_batch(3, ["x", "y"], {"x": 0.0, "y": math.nan}) in ({"x": 2, "y": 1},)


def test_the_split_is_deterministic_and_order_free() -> None:
    rates = {"c": 3.0, "a": 1.0, "b": 2.0}
    assert split_batch(17, ["c", "a", "b"], rates) == split_batch(17, ["b", "c", "a"], rates)


@given(_members, st.integers(min_value=0, max_value=5000), st.data())
def test_small_noise_keeps_the_previous_split(
    rates: dict[str, float], more: int, data: st.DataObject
) -> None:
    global_batch = len(rates) + more
    first = split_batch(global_batch, rates, rates)
    noise = {m: r * data.draw(st.floats(0.97, 1.03)) for m, r in rates.items()}
    assert split_batch(global_batch, rates, noise, previous=first, tolerance=0.1) == first


def test_a_large_drift_replaces_the_previous_split() -> None:
    first = split_batch(100, ["a", "b"], {"a": 1.0, "b": 1.0})
    assert first == {"a": 50, "b": 50}
    again = split_batch(100, ["a", "b"], {"a": 1.0, "b": 3.0}, previous=first)
    assert again == {"a": 25, "b": 75}


def test_a_previous_split_of_other_members_or_batch_is_ignored() -> None:
    prev = {"a": 50, "b": 50}
    assert split_batch(90, ["a", "b", "c"], {}, previous=prev) == {"a": 30, "b": 30, "c": 30}
    assert split_batch(60, ["a", "b"], {}, previous=prev) == {"a": 30, "b": 30}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        split_batch(4, [], {})
    with pytest.raises(ValueError, match="each of 3 members"):
        split_batch(2, ["a", "b", "c"], {})
    with pytest.raises(ValueError, match="tolerance"):
        split_batch(4, ["a"], {}, tolerance=-1.0)


def test_splitter_resplits_on_membership_and_on_drift_only() -> None:
    s = BatchSplitter(tolerance=0.1, min_interval_s=2.0)
    assert s.sizes(["a", "b"], now=0.0) == {}  # no global batch known yet
    assert not s.due(["a", "b"], now=10.0)
    s.observe("a", 100.0, 60)
    s.observe("b", 20.0, 60)
    assert s.due(["a", "b"], now=10.0)  # the global batch became known
    assert s.sizes(["a", "b"], now=10.0) == {"a": 50, "b": 10}
    s.observe("a", 103.0, 60)  # noise
    assert not s.due(["a", "b"], now=20.0)
    s.observe("b", 100.0, 60)  # b got five times faster
    assert not s.due(["a", "b"], now=11.0)  # too soon after the last change
    assert s.due(["a", "b"], now=20.0)
    assert s.sizes(["a", "b"], now=20.0) == {"a": 30, "b": 30}
    # a joiner, not measured yet: it weighs as the mean; a commit always re-splits
    assert s.sizes(["a", "b", "c"], now=20.5) == {"a": 20, "b": 20, "c": 20}
    s.forget("b")
    assert s.sizes(["a", "c"], now=21.0) == {"a": 30, "c": 30}
    assert s.sizes(["a"], now=21.0) == {"a": 60}


def test_splitter_with_fewer_samples_than_members_installs_nothing() -> None:
    s = BatchSplitter()
    s.observe("a", 1.0, 2)
    assert s.sizes(["a", "b", "c"], now=0.0) == {}
