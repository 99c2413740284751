"""Killing a cut vertex of the overlay: the survivors heal it and keep training.

Four real training processes (each with its embedded daemon) join one through the previous one,
which makes the overlay a line ``a-b-c-d``. ``kill -9`` of ``b`` (worker and daemon) splits it
although ``a``, ``c`` and ``d`` can all still reach each other: the scheduler must reconnect the
parts with connect-link, and training must go on, bitwise equal, with three members.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import Cluster, assert_equal_from, world


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_a_killed_cut_vertex_is_healed_and_training_goes_on(cluster: Cluster) -> None:
    a = cluster.start("a")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    c = cluster.start("c", b)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "c to join b")
    d = cluster.start("d", c)
    cluster.wait(lambda: all(world(m, 4) for m in (a, b, c, d)), "d to join c")
    os.killpg(b.proc.pid, signal.SIGKILL)  # the worker and its embedded daemon
    b.proc.wait(timeout=30)
    del cluster.members["b"]  # reaped; the watch below is for the survivors
    killed_at = max(a.digests())
    survivors = (a, c, d)
    cluster.wait(
        lambda: all(world(m, 3, killed_at + 10) for m in survivors),
        "a, c and d to train ten steps as three",
    )
    for m in survivors:
        assert m.proc.poll() is None, m.log()
    assert assert_equal_from(list(survivors), killed_at + 1) >= 5
