"""Training with the int8 wire format: two real trainers (embedded daemons, loopback sockets)
whose gradients travel as blockwise int8 with error feedback stay bitwise equal, with the state
audit (whose digests ride the same buffer, exact) running every few steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import Cluster, assert_equal_from, world


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def test_int8_gradients_keep_two_trainers_bitwise_equal(cluster: Cluster) -> None:
    extra = ("--wire-dtype", "int8", "--audit-every", "5", "--optimizer", "adam")
    a = cluster.start("a", None, *extra)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *extra)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    first_b = min(b.digests())
    cluster.wait(lambda: b.last()["step"] >= first_b + 15, "b to train 15 steps")
    assert assert_equal_from([a, b], first_b) >= 15
