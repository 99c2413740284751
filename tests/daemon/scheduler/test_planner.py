"""The scheduler's replication planning (``chaos.daemon.scheduler.planner.replication_policy``):
pure, no sockets. It turns measured links into the planner's neighbours and bounds the plan's
size."""

from __future__ import annotations

import pytest
from chaos.daemon.config import DaemonConfig
from chaos.daemon.scheduler import planner

MB = 1 << 20


def _cfg(**kw: object) -> DaemonConfig:
    return DaemonConfig(node_id="s", listen="tcp://127.0.0.1:5000", **kw)  # type: ignore[arg-type]


def _covered(assignment: dict[str, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The assigned (offset, length) ranges of every donor, in offset order."""
    return sorted(r for ranges in assignment.values() for r in ranges)


def test_every_byte_of_the_state_is_assigned_to_one_donor_once() -> None:
    links = {"a": (0.001, 100e6), "b": (0.002, 50e6), "c": (None, None)}
    wire = planner.replication_policy("j", links, None, [3 * MB, MB + 7], _cfg())
    assert wire.skipped == "" or wire.skipped is None
    ranges = _covered(wire.assignment)
    pos = 0
    for offset, length in ranges:
        assert offset == pos and length > 0
        pos += length
    assert pos == 4 * MB + 7
    assert {d.id for d in wire.donors} == {"a", "b", "c"}


def test_a_plan_over_the_shard_bound_is_replanned_at_a_larger_shard_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    links = {"a": (0.001, 100e6), "b": (0.001, 100e6)}
    sizes = [64 * MB]
    free = planner.replication_policy("j", links, None, sizes, _cfg())
    free_shards = sum(len(v) for v in free.assignment.values())
    assert free_shards > 4  # the planner's own choice has more shards than the bound below
    monkeypatch.setattr(planner, "MAX_PLAN_SHARDS", 4)
    bounded = planner.replication_policy("j", links, None, sizes, _cfg())
    assert bounded.shard_size >= -(-64 * MB // 4)
    assert _covered(bounded.assignment)[-1][0] < 64 * MB
    assert sum(n for ranges in bounded.assignment.values() for _, n in ranges) == 64 * MB


def test_nothing_to_plan_is_skipped_with_a_reason() -> None:
    assert planner.replication_policy("j", {"a": (0.0, 1e6)}, None, None, _cfg()).skipped
    assert planner.replication_policy("j", {}, 10 * MB, None, _cfg()).skipped == "no neighbours"
