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
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.errors import ChaosTimeout
from chaos.launch import (
    ProcessExited,
    daemon_cli,
    free_port,
    kill_and_reap,
    spawn_worker,
    wait_until,
)

WORKER = Path(__file__).with_name("worker.py")
DEADLINE_S = 120.0
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "1.0")


class Member:
    """One training process (and, in its process group, its embedded daemon)."""

    def __init__(self, node_id: str, out: Path, proc: subprocess.Popen[bytes], port: int):
        self.id = node_id
        self.out = out
        self.proc = proc
        self.address = f"tcp://127.0.0.1:{port}"

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def digests(self) -> dict[int, str]:
        return {r["step"]: r["digest"] for r in self.records() if "digest" in r}

    def last(self) -> dict[str, Any]:
        steps = [r for r in self.records() if "digest" in r]
        return steps[-1] if steps else {}

    def leave(self) -> None:
        self.out.with_suffix(".leave").touch()

    def log(self) -> str:
        path = self.out.with_suffix(".log")
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Cluster:
    """Starts workers in their own sessions; kills every process group on close."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.members: dict[str, Member] = {}

    daemon_args: tuple[str, ...] = DAEMON_ARGS

    def node_args(self, node_id: str) -> list[str]:
        """Worker arguments every member gets (subclasses add theirs)."""
        return []

    def start(self, node_id: str, join: Member | None = None, *extra: str) -> Member:
        port = free_port()
        out = self.tmp / f"{node_id}.jsonl"
        argv = [sys.executable, str(WORKER), "--id", node_id, "--out", str(out)]
        argv += ["--listen", f"tcp://127.0.0.1:{port}", *self.node_args(node_id), *extra]
        for arg in self.daemon_args:
            argv.append(f"--daemon-arg={arg}")
        if join is not None:
            argv += ["--join", join.address]
        proc = spawn_worker(argv, log_path=out.with_suffix(".log"), append=False)
        member = Member(node_id, out, proc, port)
        self.members[node_id] = member
        return member

    def wait(self, pred: Callable[[], Any], what: str) -> Any:
        procs = {m.id: m.proc for m in self.members.values()}
        try:  # exit code 70: a member that was made to fail
            return wait_until(pred, DEADLINE_S, what, poll_s=0.1, watch=procs, ok=(0, 70))
        except ProcessExited as exc:
            pytest.fail(f"{exc}:\n{self.members[exc.name].log()}")
        except ChaosTimeout as exc:
            logs = "\n".join(f"--- {m.id}\n{m.log()}" for m in self.members.values())
            pytest.fail(f"{exc}\n{logs}")

    def close(self) -> None:
        kill_and_reap([m.proc for m in self.members.values()], group=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def _world(member: Member, size: int, after_step: int = 0) -> bool:
    last = member.last()
    return bool(last) and last["world"] == size and last["step"] > after_step


def _assert_equal_from(members: list[Member], first_step: int) -> int:
    """Every step from ``first_step`` that all members recorded has one digest; returns the
    number of steps compared."""
    digests = [m.digests() for m in members]
    common = set.intersection(*(set(d) for d in digests))
    common = {s for s in common if s >= first_step}
    assert common, "the members recorded no common step"
    for step in sorted(common):
        seen = {d[step] for d in digests}
        assert len(seen) == 1, f"members differ at step {step}"
    return len(common)


def _start_pair(cluster: Cluster, *extra: str) -> tuple[Member, Member]:
    a = cluster.start("a", None, *extra)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *extra)
    cluster.wait(lambda: _world(a, 2) and _world(b, 2), "b to join a")
    return a, b


def test_join_mid_training_is_bitwise_equal(cluster: Cluster) -> None:
    a, b = _start_pair(cluster, "--optimizer", "adam")
    step_before = a.last()["step"]
    c = cluster.start("c", b, "--optimizer", "adam")
    cluster.wait(lambda: all(_world(m, 3, step_before) for m in (a, b, c)), "c to join")
    first_c = min(c.digests())
    assert first_c > step_before, "the joiner took part only after the others had trained"
    ready = next(r for r in c.records() if r.get("ready"))
    assert ready["step"] >= step_before
    cluster.wait(lambda: c.last()["step"] >= first_c + 10, "c to train 10 steps")
    assert _assert_equal_from([a, b, c], first_c) >= 10


def test_leave_shrinks_the_cluster_and_the_rest_go_on(cluster: Cluster) -> None:
    a, b = _start_pair(cluster)
    c = cluster.start("c", a)
    cluster.wait(lambda: all(_world(m, 3) for m in (a, b, c)), "three members")
    b.leave()
    cluster.wait(lambda: any(r.get("left") for r in b.records()), "b to leave")
    left_at = next(r["step"] for r in b.records() if r.get("left"))
    cluster.wait(lambda: _world(a, 2, left_at + 5) and _world(c, 2, left_at + 5), "a, c to go on")
    assert b.proc.wait(timeout=30) == 0
    _assert_equal_from([a, c], left_at)


def test_member_killed_mid_allreduce_survivors_stay_equal(cluster: Cluster) -> None:
    a, b = _start_pair(cluster)
    c = cluster.start("c", a, "--die-after", "20")
    cluster.wait(lambda: c.proc.poll() is not None, "c to die mid-allreduce")
    assert c.proc.returncode == 70, c.log()
    died = max(c.digests())
    assert any(r.get("world") == 3 for r in a.records()), "c never took part in a step"
    cluster.wait(lambda: _world(a, 2, died + 10) and _world(b, 2, died + 10), "survivors go on")
    assert _assert_equal_from([a, b], died - 5) >= 10


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(daemon_cli(*args), capture_output=True, text=True, timeout=60)


def test_link_removal_changes_the_policy_and_training_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    # link changes over TCP (--connect) need the cluster key: its daemons and the CLI share one
    key = tmp_path / "cluster.key"
    assert _cli("keygen", str(key)).returncode == 0
    keyed = f"--daemon-arg=--cluster-key={key}"
    a, b = _start_pair(cluster, keyed)
    c = cluster.start("c", a, keyed)  # overlay: a-b, a-c
    cluster.wait(lambda: all(_world(m, 3) for m in (a, b, c)), "three members")
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
        lambda: all(m.last()["epoch"] >= removal and _world(m, 3) for m in (a, b, c)),
        "the new sync policy",
    )
    first = max(m.last()["step"] for m in (a, b, c))
    cluster.wait(lambda: all(m.last()["step"] > first + 10 for m in (a, b, c)), "10 more steps")
    assert _assert_equal_from([a, b, c], first) >= 10
    status = _cli("status", "--connect", c.address, "--cluster-key", str(key), "--json")
    links = {tuple(sorted((lk["a"], lk["b"]))) for lk in json.loads(status.stdout)["links"]}
    assert ("a", "b") not in links and ("b", "c") in links, links
