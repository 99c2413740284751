"""Faults the way the world makes them: two members killed together (one of them a cut vertex
of the overlay), and a killed device coming back under its own id. Real training processes,
each with its embedded daemon, over loopback; faults by name (``kill -9`` of a member's
process group). No timing is asserted; every process group is killed and reaped at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def _kill(cluster: Cluster, *members: Member) -> None:
    """``kill -9`` of each member's process group, one right after the other (no wait between),
    then reaps them; they are no longer watched."""
    for m in members:
        os.killpg(m.proc.pid, signal.SIGKILL)
    for m in members:
        m.proc.wait(timeout=30)
        del cluster.members[m.id]


def test_two_members_killed_together_one_a_cut_vertex_the_rest_go_on_equal(
    cluster: Cluster,
) -> None:
    """Overlay a-b, a-c, b-d, c-e: c and d die within a millisecond of each other, and c was
    e's only link. The scheduler heals e back in, and a, b and e train on, bitwise equal."""
    a = cluster.start("a", None)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    c = cluster.start("c", a)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "three members")
    d = cluster.start("d", b)
    e = cluster.start("e", c)
    cluster.wait(lambda: all(world(m, 5) for m in (a, b, c, d, e)), "five members")
    _kill(cluster, c, d)
    killed_at = max(m.last()["step"] for m in (a, b, e))
    cluster.wait(lambda: all(world(m, 3, killed_at + 10) for m in (a, b, e)),
                 "a, b and e to train on as three")  # fmt: skip
    assert assert_equal_from([a, b, e], killed_at + 1) >= 10


def test_a_killed_device_comes_back_under_its_own_id(cluster: Cluster) -> None:
    """b is killed, the others go on without it, and a new process with b's id joins again
    (through c): it is a member again, trains, and holds the others' state bit for bit."""
    a = cluster.start("a", None)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    c = cluster.start("c", a)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "three members")
    _kill(cluster, b)
    gone_at = max(m.last()["step"] for m in (a, c))
    cluster.wait(lambda: world(a, 2, gone_at + 5) and world(c, 2, gone_at + 5), "a, c go on")
    b.out.unlink()  # the new process's records only
    back = cluster.start("b", c)
    cluster.wait(lambda: all(world(m, 3) for m in (a, back, c)), "b to be a member again")
    first = min(back.digests())
    cluster.wait(lambda: back.last()["step"] >= first + 10, "b to train 10 steps")
    assert assert_equal_from([a, back, c], first) >= 10
