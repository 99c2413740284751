"""Training with a cluster key, end to end: three real trainers (each with its embedded daemon)
join with one key; every trainer's key is in the sync policy, so the data plane accepts frames
only from each member's own connection; a member killed mid-training leaves the others bitwise
equal, as without a key."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import KeyedCluster, assert_equal_from, world


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KeyedCluster]:
    with contextlib.closing(KeyedCluster(tmp_path)) as c:
        yield c


def test_keyed_trainers_train_bind_their_keys_and_survive_a_kill(cluster: KeyedCluster) -> None:
    a = cluster.start("a")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    c = cluster.start("c", a)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "b and c to join")
    sync = cluster.status("a").sync
    assert sync is not None and set(sync.keys) == {"a", "b", "c"}
    assert len(set(sync.keys.values())) == 3 and all(len(k) == 40 for k in sync.keys.values())
    joined = max(c.digests())
    cluster.wait(lambda: all(world(m, 3, joined + 5) for m in (a, b, c)), "five steps as three")
    os.killpg(c.proc.pid, signal.SIGKILL)
    c.proc.wait(timeout=30)
    del cluster.members["c"]
    killed = max(a.digests())
    cluster.wait(lambda: world(a, 2, killed + 5) and world(b, 2, killed + 5), "a, b go on")
    assert assert_equal_from([a, b], joined) >= 10
