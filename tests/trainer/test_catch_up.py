"""Catch-up joins with real trainer processes on loopback (``TrainerConfig.join_mode``).

Four members: ``a``, ``b``, ``c`` train; ``d`` joins through ``c`` (its only neighbour, so its
only donor). In catch-up mode the members keep stepping while ``d`` pulls the snapshot and
replays the logged steps; ``d`` then enters and pulls only what still differs, and ends bitwise
equal. A donor whose step log is full makes the joiner fall back to pulling what differs (all of
it); a barrier join still works. No timing is asserted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.replication.server import DIE_EXIT_CODE
from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, in_order, world

WIDTH = ("--width", "512")  # parameters and momentum well above the runtime record's size


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def _event(m: Member, name: str) -> dict[str, Any] | None:
    return next((r for r in m.records() if r.get("event") == name), None)


def _events(*members: Member) -> dict[str, list[tuple[Any, ...]]]:
    """Every member's events, to tell what happened when an assertion fails."""
    return {m.id: [(r["event"], r.get("step"), r.get("epoch")) for r in m.records() if "event" in r]
            for m in members}  # fmt: skip


def _three(cluster: Cluster, *c_args: str) -> tuple[Member, Member, Member]:
    a = cluster.start("a", None, *WIDTH)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *WIDTH)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    c = cluster.start("c", b, *WIDTH, *c_args)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "c to join")
    # the scheduler plans a catch-up once it measured the donors' step period
    cluster.wait(lambda: c.last().get("step", 0) >= a.last()["step"] - 1 >= 0, "c to train")
    return a, b, c


def _joined(cluster: Cluster, members: list[Member], d: Member) -> int:
    cluster.wait(lambda: _event(d, "entered") is not None and d.digests(), "d to enter")
    first = min(d.digests())
    cluster.wait(lambda: all(world(m, 4, first + 5) for m in (*members, d)), "four to train")
    assert assert_equal_from([*members, d], first) >= 5
    return first


def test_members_train_on_while_a_joiner_catches_up(cluster: Cluster) -> None:
    a, b, c = _three(cluster)
    # d computes its first step for 0.5 s (a slow device): the members step on meanwhile
    d = cluster.start("d", c, *WIDTH, "--step-time", "0.5")
    _joined(cluster, [a, b, c], d)
    pulled, entered = _event(d, "snapshot_pulled"), _event(d, "entered")
    assert pulled is not None and entered is not None, d.log()
    s0, s_enter = pulled["step"], entered["step"]
    # a and b are not donors (d's only neighbour is c): they stepped between the snapshot and
    # d's entry, in a three-member world. The record of the entry step itself may name the
    # four-member policy: a member whose round of that step was interrupted by the entry's
    # commit completes it under the new policy with the result the others kept (computed by
    # the three), so only the steps before it are checked
    assert s_enter > s0 + 1
    for m in (a, b):
        during = [r for r in m.records() if "digest" in r and s0 < r["step"] < s_enter]
        off = [(r["step"], r["epoch"], r["world"]) for r in during if r["world"] != 3]
        assert during and not off, (m.id, s0, s_enter, off, _events(a, b, c, d))
    caught = _event(d, "replayed")
    assert caught is not None and entered["replayed"] > 0
    # the replay was exact: at entry d pulled only what the replay does not reproduce (the
    # runtime record), not the parameters or the optimizer state
    assert entered["pulled_bytes"] < 0.25 * entered["state_bytes"], entered
    def served_d(m: Member) -> list[dict[str, Any]]:
        return [r for r in m.records() if r.get("event") == "serving" and r["joiner"] == "d"]

    assert any(r.get("catch_up") for r in served_d(c)), "the donor served a catch-up snapshot"
    assert not served_d(a) and not served_d(b)


def test_a_joiner_whose_only_donor_dies_mid_pull_gets_in_through_the_others(
    cluster: Cluster,
) -> None:
    # c dies (kill -9 of the device) at d's first shard request: d's only neighbour and donor
    # is lost mid-pull, and the overlay is split ({a, b} | {d})
    a, b, c = _three(cluster, "--die-serving-after", "0")
    d = cluster.start("d", c, *WIDTH)
    cluster.wait(lambda: c.proc.poll() is not None, "c to die serving d")
    assert c.proc.returncode == DIE_EXIT_CODE, c.log()
    # the scheduler connects d to the survivors, and d gets the state from them; until then
    # each update() of d returns without a step (its entry failed, it joined again)
    def shared() -> list[dict[str, Any]]:
        return [r for r in d.records() if "digest" in r and r["world"] > 1]

    cluster.wait(shared, "d to train with the others")
    first = min(r["step"] for r in shared())
    # every state d ever held past its initial model is one a held at that step (the pulled
    # snapshot, or a step taken with the others): it never stepped on a state of its own
    theirs = a.digests()
    mine = [r for r in d.records() if "digest" in r and r["step"] > 0]
    assert mine and all(r["digest"] == theirs[r["step"]] for r in mine if r["step"] in theirs)
    cluster.wait(lambda: all(world(m, 3, first + 5) for m in (a, b, d)), "a, b and d to train")
    assert assert_equal_from([a, b, d], first) >= 5
    failed = [e for e in ("snapshot_failed", "entry_failed") if _event(d, e) is not None]
    assert failed, _events(d)  # the lost pull was noticed, not silently skipped
    assert d.proc.poll() is None and a.proc.poll() is None and b.proc.poll() is None


def test_a_full_step_log_falls_back_to_pulling_what_differs(cluster: Cluster) -> None:
    a = cluster.start("a", None, *WIDTH, "--catch-up-log-bytes", "0")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *WIDTH, "--catch-up-log-bytes", "0")
    cluster.wait(lambda: world(a, 2, 10) and world(b, 2, 10), "b to join")
    c = cluster.start("c", b, *WIDTH, "--step-time", "0.5")  # the members step on meanwhile
    cluster.wait(lambda: _event(c, "entered") is not None and c.digests(), "c to enter")
    first = min(c.digests())
    cluster.wait(lambda: all(world(m, 3, first + 5) for m in (a, b, c)), "three to train")
    assert assert_equal_from([a, b, c], first) >= 5
    entered = _event(c, "entered")
    assert entered is not None
    # nothing was logged: the joiner replayed nothing and pulled the trained chunks again
    pulled = _event(c, "snapshot_pulled")
    assert pulled is not None and entered["step"] > pulled["step"]
    assert entered["replayed"] == 0
    assert entered["pulled_bytes"] > 0.5 * entered["state_bytes"], entered


def test_barrier_join_still_works(cluster: Cluster) -> None:
    a, b, c = _three(cluster)
    d = cluster.start("d", c, *WIDTH, "--join-mode", "barrier")
    cluster.wait(lambda: d.digests(), "d to train")
    first = min(d.digests())
    cluster.wait(lambda: all(world(m, 4, first + 5) for m in (a, b, c, d)), "four to train")
    assert assert_equal_from([a, b, c, d], first) >= 5
    assert _event(d, "entered") is None and _event(d, "snapshot_pulled") is None


def test_a_loop_that_sets_the_lr_from_the_step_stays_equal_after_a_catch_up(
    cluster: Cluster,
) -> None:
    # nanoGPT's loop: AdamW with two parameter groups, every group's lr set from trainer.step
    # before update() (a new value every step), the local gradient clipped first. A joiner that
    # catches up over several steps must not run a live step in the same update() call as its
    # entry: that step would run with the lr the loop set for the step it stood at before
    loop = (*WIDTH, "--optimizer", "adamw", "--lr-from-step", "--clip", "1.0")
    a = cluster.start("a", None, *loop)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *loop)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    cluster.wait(lambda: b.last().get("step", 0) >= a.last()["step"] - 1 >= 0, "b to train")
    c = cluster.start("c", b, *loop, "--step-time", "0.5")  # the members step on meanwhile
    cluster.wait(lambda: _event(c, "entered") is not None and c.digests(), "c to enter")
    first = min(c.digests())
    cluster.wait(lambda: all(world(m, 3, first + 10) for m in (a, b, c)), "three to train")
    entered, replayed = _event(c, "entered"), _event(c, "replayed")
    assert entered is not None and replayed is not None, _events(a, b, c)
    assert entered["replayed"] > 0, _events(a, b, c)  # it caught up over logged steps
    # the entry's update() took no live step of its own: it took part in the entry step with
    # weight 0 and the members' hyperparameters (pulled with their state), so its first record
    # is one step on
    assert first == entered["step"] + 1
    phases = c.phases()  # its lifecycle, each move named by the trainer itself
    assert in_order(phases, ["pulling", "catching_up", "entering", "live"]), phases
    assert phases[-1] == "live" and "rejoining" not in phases, phases
    assert assert_equal_from([a, b, c], first) >= 10
    # the digests cover parameters and optimizer state; the lr each step ran with must match
    # too. A record of step s holds the lr that step s - 1 ran with (the loop set it before that
    # call); the joiner's first holds the lr of its entry step: the donors', whatever its loop
    # had set by then
    lrs = [{r["step"]: r["lr"] for r in m.records() if "lr" in r} for m in (a, b, c)]
    for step in sorted(set.intersection(*(set(x) for x in lrs))):
        if step >= first:
            assert len({x[step] for x in lrs}) == 1, (step, [x[step] for x in lrs])
