"""A join in progress as the scheduler's ``status`` shows it, with real processes: a keyed
founder and a joiner pulling a 50 MB state (Adam over a wide model); the joiner's trainer
reports its pull through its daemon to the scheduler, whose status lists the join with its
bytes and donors until the joiner trains. The dashboard draws that list."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.protocol import TrainerPhase
from tests.trainer.trainer_cluster import KeyedCluster, world

WIDE = ("--width", "200000", "--optimizer", "adam")  # about 50 MB of state


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KeyedCluster]:
    with contextlib.closing(KeyedCluster(tmp_path)) as c:  # reaped even on failure
        yield c


def test_the_scheduler_shows_a_joins_pull(cluster: KeyedCluster) -> None:
    a = cluster.start("a", None, *WIDE)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *WIDE)
    pulls = []
    deadline = time.monotonic() + 120.0
    while not world(b, 2) and time.monotonic() < deadline:
        st = cluster.status("a")  # a is the scheduler
        pulls += [(j.pull, j.donors) for j in st.joins if j.id == "b" and j.pull is not None]
        time.sleep(0.02)
    assert world(b, 2), b.log()
    assert pulls, "the scheduler never showed b's pull"
    # the snapshot's pull (the whole state), then maybe the entry's (what still differed)
    whole = [(p, d) for p, d in pulls if p.total_bytes > 40_000_000]
    assert whole, pulls
    last, donors = whole[-1]
    assert last.pulled_bytes == last.total_bytes
    assert donors == ["a"] and last.donors == {"a": last.total_bytes}
    assert all(p.pulled_bytes <= p.total_bytes for p, _ in pulls)
    # b trains: no longer a join, once its ready report (sent after its entry step) is in
    cluster.wait(lambda: not [j for j in cluster.status("a").joins if j.id == "b"],
                 "the scheduler to end b's join")  # fmt: skip
    # every member's trainer says it is live (its beacon, through its daemon, to the scheduler)
    live = {"a": TrainerPhase.LIVE, "b": TrainerPhase.LIVE}
    cluster.wait(lambda: {x.id: x.phase for x in cluster.status("a").activity} == live,
                 "both to be live")  # fmt: skip
    assert cluster.status("b").trainer_phase is TrainerPhase.LIVE
    st = cluster.status("a")
    assert {x.id for x in st.activity} == {"a", "b"}
