"""Trainer integration tests: 3-4 real training processes, each with its embedded daemon,
talking over loopback sockets.

Each worker (``worker.py``) appends one JSON line per step with a digest of its model and
optimizer state; members are bitwise equal when their digests at the same step are equal.
Faults are injected by name (``--die-at-step``: ``kill -9`` of the device mid-allreduce) or
through the daemon's CLI client (link removal). Tests never assert timing; they wait for
conditions with generous deadlines, and every process group is killed and reaped at the end.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.launch import daemon_cli
from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def _start_pair(cluster: Cluster, *extra: str) -> tuple[Member, Member]:
    a = cluster.start("a", None, *extra)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *extra)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    return a, b


def test_join_mid_training_is_bitwise_equal(cluster: Cluster) -> None:
    a, b = _start_pair(cluster, "--optimizer", "adam")
    step_before = a.last()["step"]
    c = cluster.start("c", b, "--optimizer", "adam")
    cluster.wait(lambda: all(world(m, 3, step_before) for m in (a, b, c)), "c to join")
    first_c = min(c.digests())
    assert first_c > step_before, "the joiner took part only after the others had trained"
    ready = next(r for r in c.records() if r.get("ready"))
    assert ready["step"] >= step_before
    cluster.wait(lambda: c.last()["step"] >= first_c + 10, "c to train 10 steps")
    assert assert_equal_from([a, b, c], first_c) >= 10


def test_leave_shrinks_the_cluster_and_the_rest_go_on(cluster: Cluster) -> None:
    a, b = _start_pair(cluster)
    c = cluster.start("c", a)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "three members")
    b.leave()
    cluster.wait(lambda: any(r.get("left") for r in b.records()), "b to leave")
    left_at = next(r["step"] for r in b.records() if r.get("left"))
    cluster.wait(lambda: world(a, 2, left_at + 5) and world(c, 2, left_at + 5), "a, c to go on")
    assert b.proc.wait(timeout=30) == 0
    assert_equal_from([a, c], left_at)


def test_member_killed_mid_allreduce_survivors_stay_equal(cluster: Cluster) -> None:
    a, b = _start_pair(cluster)
    c = cluster.start("c", a, "--die-after", "20")
    cluster.wait(lambda: c.proc.poll() is not None, "c to die mid-allreduce")
    assert c.proc.returncode == 70, c.log()
    died = max(c.digests())
    assert any(r.get("world") == 3 for r in a.records()), "c never took part in a step"
    cluster.wait(lambda: world(a, 2, died + 10) and world(b, 2, died + 10), "survivors go on")
    assert assert_equal_from([a, b], died - 5) >= 10


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(daemon_cli(*args), capture_output=True, text=True, timeout=60)


def test_link_removal_changes_the_policy_and_training_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    # link changes over TCP (--connect) need the cluster key: its daemons and the CLI share one
    key = tmp_path / "cluster.key"
    assert _cli("keygen", str(key)).returncode == 0
    keyed = (f"--daemon-arg=--cluster-key={key}", "--daemon-arg=--allow-remote-operator")
    a, b = _start_pair(cluster, *keyed)
    c = cluster.start("c", a, *keyed)  # overlay: a-b, a-c
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "three members")
    added = _cli("link", "add", "c", "--connect", b.address, "--cluster-key", str(key))
    assert added.returncode == 0, added.stderr
    # overlay: a-c, b-c
    removed = _cli("link", "remove", "b", "--connect", a.address, "--cluster-key", str(key))
    assert removed.returncode == 0, removed.stderr
    # every member acknowledged the removal's epoch before the CLI returned
    status = _cli("status", "--connect", a.address, "--cluster-key", str(key), "--json")
    assert status.returncode == 0, status.stderr
    removal = json.loads(status.stdout)["epoch"]
    cluster.wait(
        lambda: all(m.last()["epoch"] >= removal and world(m, 3) for m in (a, b, c)),
        "the new sync policy",
    )
    first = max(m.last()["step"] for m in (a, b, c))
    cluster.wait(lambda: all(m.last()["step"] > first + 10 for m in (a, b, c)), "10 more steps")
    assert assert_equal_from([a, b, c], first) >= 10
    status = _cli("status", "--connect", c.address, "--cluster-key", str(key), "--json")
    links = {tuple(sorted((lk["a"], lk["b"]))) for lk in json.loads(status.stdout)["links"]}
    assert ("a", "b") not in links and ("b", "c") in links, links
