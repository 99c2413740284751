"""A constant global batch with real processes: the scheduler splits it across the members in
proportion to their measured throughput, installs the split with every membership change
(join, leave, kill), and the sizes in force always sum to the global batch.

Each worker (``semantics_worker.py --global-batch G``) uses ``trainer.local_batch_size``
samples a step, passes it as ``num_samples`` and records the split in force; one member is
made slower by a sleep per sample. Tests wait for conditions, never assert timing, and kill and
reap every process group at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.trainer_cluster import (
    SEMANTICS_WORKER,
    Cluster,
    Member,
    assert_equal_from,
    world,
)

GLOBAL = 48


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path, SEMANTICS_WORKER)) as c:  # reaped even on failure
        yield c


def _split_of(member: Member, ids: set[str], after_step: int = 0) -> dict[str, int] | None:
    """The latest split ``member`` recorded over exactly ``ids``, past ``after_step``."""
    for r in reversed(member.records()):
        if r.get("step", 0) <= after_step:
            return None
        split = r.get("split")
        if split and set(split) == ids:
            return dict(split)
    return None


def _check_sums(members: list[Member]) -> int:
    """Every split any member recorded sums to the global batch, names as many members as
    the step's world and gives each at least one sample, and the member used its size in its
    next step (under the same epoch); returns the records checked."""
    checked = 0
    for m in members:
        prev: dict[str, Any] = {}
        for r in m.records():
            split: dict[str, Any] | None = r.get("split")
            if "step" in r and prev.get("split") and prev["epoch"] == r.get("epoch"):
                # the step after a record used the size that record's split gave it
                assert r["batch"] == prev["split"][m.id], (m.id, prev, r)
            prev = r
            if not split:
                continue
            assert sum(split.values()) == GLOBAL, (m.id, r)
            assert len(split) == r["world"], (m.id, r)
            assert min(split.values()) >= 1
            checked += 1
    return checked


def test_the_split_follows_joins_leaves_and_kills(cluster: Cluster) -> None:
    # compute time in proportion to the samples: 2 ms a sample, and 10 ms on the slow b
    gb = ("--global-batch", str(GLOBAL), "--step-time", "0", "--sample-time", "0.002")
    slow = ("--sample-time", "0.01")
    a = cluster.start("a", None, *gb)
    cluster.wait(lambda: a.last().get("step", 0) >= 5, "a to train")
    # alone, a uses the whole global batch
    cluster.wait(lambda: a.last().get("batch") == GLOBAL, "a to use the global batch")
    b = cluster.start("b", a, *gb, *slow)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    # the join installs a split over a and b; measured, the slow b gets less than a
    cluster.wait(
        lambda: (s := _split_of(a, {"a", "b"})) is not None and s["b"] < s["a"],
        "a split over a and b by speed",
    )
    c = cluster.start("c", b, *gb)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "c to join")
    cluster.wait(
        lambda: (s := _split_of(c, {"a", "b", "c"})) is not None and s["b"] < min(s["a"], s["c"]),
        "a split over a, b and c by speed",
    )
    # a kill: d joins, trains, dies mid-allreduce; the split goes back to a, b and c
    d = cluster.start("d", a, *gb, "--die-after", "12")
    cluster.wait(lambda: d.proc.poll() is not None, "d to join, train and die")
    assert d.proc.returncode == 70, d.log()
    assert _split_of(d, {"a", "b", "c", "d"}, -1) is not None, "d never had a split with it"
    died = max(d.digests())
    cluster.wait(
        lambda: (
            all(world(m, 3, died) for m in (a, b, c))
            and all(_split_of(m, {"a", "b", "c"}, died) is not None for m in (a, b, c))
        ),
        "the split over the survivors",
    )
    # a leave: c leaves gracefully; the split goes back to a and b
    c.leave()
    cluster.wait(lambda: any(r.get("left") for r in c.records()), "c to leave")
    left_at = next(r["step"] for r in c.records() if r.get("left"))
    cluster.wait(
        lambda: (
            all(world(m, 2, left_at + 3) for m in (a, b))
            and all(_split_of(m, {"a", "b"}, left_at) is not None for m in (a, b))
        ),
        "the split over a and b",
    )
    assert _check_sums([a, b, c, d]) > 20
    assert assert_equal_from([a, b], left_at) >= 3
