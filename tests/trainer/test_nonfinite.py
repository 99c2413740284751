"""One device's NaN, inf or exploding gradient, with real processes: three members, one of them
spoils its own gradients once (``finite_worker.py --poison``). Every member must skip that step
alike (or raise alike), end finite and bitwise equal, and record ``nonfinite_gradient`` naming
the device. A device that spoils every step is evicted by the scheduler after
``--offender-limit`` such steps, and the others train on, finite and bitwise equal. A catching-up
joiner whose replayed log holds a skipped step skips it alike. Tests wait for conditions with
generous deadlines, never assert timing, and kill and reap every process group at the end."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world

FINITE_WORKER = Path(__file__).with_name("finite_worker.py")
POISON_AT = 8
"""The first step at which the bad device spoils its gradients (once all three train)."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path, FINITE_WORKER)) as c:  # reaped even on failure
        yield c


def _start(cluster: Cluster, bad: str, *extra: str) -> list[Member]:
    members: list[Member] = []
    for i, node in enumerate(["a", "b", "c"]):
        args = [*extra, "--poison", f"{POISON_AT}:{bad}"] if node == "b" else list(extra)
        m = cluster.start(node, members[0] if members else None, *args)
        members.append(m)
        cluster.wait(lambda n=i + 1: all(world(x, n) for x in members), f"{node} to take part")
    return members


def _events(m: Member) -> list[dict[str, Any]]:
    return [r for r in m.records() if r.get("event") == "nonfinite_gradient"]


def _poisoned_step(m: Member) -> int | None:
    steps = [r["step"] for r in m.records() if "poisoned" in r]
    return steps[0] if steps else None


@pytest.mark.parametrize(
    ("bad", "extra"),
    [("nan", ()), ("inf", ()), ("scale", ("--optimizer", "adam", "--max-grad-norm", "1e6"))],
    ids=["nan", "one-inf", "x1e30-adam-norm-bound"],
)
def test_one_bad_device_is_skipped_alike_and_named(
    cluster: Cluster, bad: str, extra: tuple[str, ...]
) -> None:
    members = _start(cluster, bad, *extra)
    b = members[1]
    cluster.wait(lambda: _poisoned_step(b) is not None, "b to spoil its gradients")
    k = _poisoned_step(b)
    assert k is not None
    cluster.wait(lambda: all(m.last().get("step", 0) > k + 10 for m in members),
                 "every member to train on past the bad step")  # fmt: skip
    for m in members:
        m.leave()
    cluster.wait(lambda: all(m.proc.poll() is not None for m in members), "every member to leave")
    for m in members:
        events = _events(m)
        assert [e["step"] for e in events] == [k], f"{m.id}: {events}"
        assert events[0]["devices"] == ["b"] and events[0]["action"] == "skipped"
        assert events[0]["offences"] == {"b": 1}
        assert (events[0]["local"] is not None) == (m.id == "b")
        steps = [r for r in m.records() if "digest" in r]
        assert all(r["finite"] for r in steps), f"{m.id} holds a non-finite state"
        assert steps[-1]["offences"] == {"b": 1}
    compared = assert_equal_from(members, k - 2)
    assert compared > 8


def test_raise_mode_raises_on_every_member_at_the_same_step(cluster: Cluster) -> None:
    members = _start(cluster, "nan", "--nonfinite", "raise")
    cluster.wait(lambda: all(any("raised" in r for r in m.records()) for m in members),
                 "every member to raise NonFiniteGradient")  # fmt: skip
    cluster.wait(lambda: all(m.proc.poll() is not None for m in members), "every member to exit")
    k = _poisoned_step(members[1])
    raised = [next(r for r in m.records() if "raised" in r) for m in members]
    assert {r["step"] for r in raised} == {k}
    assert all(r["devices"] == ["b"] for r in raised)
    assert all("not finite" in r["raised"] and "b" in r["raised"] for r in raised)
    assert len({r["digest"] for r in raised}) == 1  # nobody stepped: the same state everywhere
    assert all(m.proc.returncode == 0 for m in members)


@pytest.mark.parametrize(
    ("bad", "extra"),
    [("nan", ("--nonfinite", "off")), ("scale", ("--optimizer", "adam"))],
    ids=["nan-check-off", "x1e30-adam-no-norm-bound"],
)
def test_without_the_check_one_bad_device_poisons_every_member(
    cluster: Cluster, bad: str, extra: tuple[str, ...]
) -> None:
    """What the check prevents: with it off, one device's NaN reaches every member; without a
    norm bound, a finite x1e30 gradient passes and overflows Adam's state on every member."""
    members = _start(cluster, bad, *extra)
    b = members[1]
    cluster.wait(lambda: _poisoned_step(b) is not None, "b to spoil its gradients")
    k = _poisoned_step(b)
    assert k is not None
    cluster.wait(lambda: all(m.last().get("step", 0) > k + 3 for m in members),
                 "every member to train on past the bad step")  # fmt: skip
    for m in members:
        assert _events(m) == [], f"{m.id} saw a bad step it should not have seen"
        after = [r for r in m.records() if "digest" in r and r["step"] > k]
        assert after and not any(r["finite"] for r in after), f"{m.id} stayed finite"
    assert_equal_from(members, k)  # poisoned alike: still bitwise equal


# -- a device that spoils every step: the scheduler evicts it --------------------------------

OFFENDER_LIMIT = 3


class _LoggedCluster(Cluster):
    """Members whose embedded daemons keep their event logs in the test's directory."""

    daemon_args = (*Cluster.daemon_args, "--offender-limit", str(OFFENDER_LIMIT),
                   "--offender-window", "100")  # fmt: skip

    def node_args(self, node_id: str) -> list[str]:
        return ["--daemon-dir", str(self.tmp / f"d-{node_id}")]

    def daemon_events(self, kind: str) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.tmp.glob("d-*/events-*.jsonl")):
            lines = path.read_text().splitlines()
            found += [e for e in map(json.loads, (x for x in lines if x.endswith("}")))
                      if e["event"] == kind]  # fmt: skip
        return found


def test_a_device_that_spoils_every_step_is_evicted_after_the_limit(tmp_path: Path) -> None:
    with contextlib.closing(_LoggedCluster(tmp_path, FINITE_WORKER)) as cluster:
        members: list[Member] = []
        for i, node in enumerate(["a", "b", "c"]):
            args = ["--poison-from", f"{POISON_AT}:nan", "--exit-when-evicted"] if node == "b" \
                else []  # fmt: skip
            members.append(cluster.start(node, members[0] if members else None, *args))
            cluster.wait(lambda n=i + 1: all(world(x, n) for x in members), f"{node} to take part")
        a, b, c = members
        cluster.wait(lambda: cluster.daemon_events("offender_evicted"), "b to be evicted")
        cluster.wait(lambda: any("exited_evicted" in r for r in b.records()), "b to exit")
        [ev] = cluster.daemon_events("offender_evicted")
        assert ev["peer"] == "b" and ev["offences"] == OFFENDER_LIMIT, ev
        assert ev["limit"] == OFFENDER_LIMIT and ev["window_steps"] == 100
        first = min(r["step"] for r in b.records() if "poisoned" in r)
        assert first >= POISON_AT and ev["steps"][0] >= first
        # a and c train on as two, finite, past the eviction
        top = max(ev["steps"])
        cluster.wait(lambda: all(world(m, 2, top + 10) for m in (a, c)), "a and c to train on")
        for m in (a, c):
            m.leave()
        cluster.wait(lambda: all(m.proc.poll() is not None for m in members), "all to exit")
        for m in (a, c):
            skipped = [e["step"] for e in _events(m)]
            assert all(e["devices"] == ["b"] for e in _events(m)), _events(m)
            # every offence the scheduler counted is a step every member skipped; it counted
            # the limit and no more, and at most a few more steps were skipped while its
            # eviction reached the members
            assert set(ev["steps"]) <= set(skipped) and skipped[0] == first, (m.id, skipped)
            assert skipped == list(range(first, first + len(skipped)))
            steps = [r for r in m.records() if "digest" in r]
            assert all(r["finite"] for r in steps), f"{m.id} holds a non-finite state"
            assert any(r["world"] == 2 and r["step"] > skipped[-1] for r in steps)
        assert assert_equal_from([a, c], first - 2) > 10
        assert b.proc.returncode == 0


# -- a catching-up joiner replays a skipped step: it skips it alike ---------------------------

WIDE = ("--width", "512")  # parameters and momentum well above the runtime record's size


def test_a_catching_up_joiner_skips_a_logged_non_finite_step_alike(cluster: Cluster) -> None:
    """d joins through c (its only neighbour, so its donor) in catch-up mode; c spoils its own
    gradients in the first step it logs for d, which every member skips. d replays that step
    from c's log: it must skip it too (event ``nonfinite_gradient``, ``replayed``), so that at
    its entry it pulls only the runtime record, and end bitwise equal."""
    a = cluster.start("a", None, *WIDE)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a, *WIDE)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    c = cluster.start("c", b, *WIDE, "--poison-when-serving", "nan")  # c serves d alone
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "c to join")
    cluster.wait(lambda: c.last().get("step", 0) >= a.last()["step"] - 1 >= 0, "c to train")
    # d computes its first step for 0.5 s: the members step on, logging, meanwhile
    d = cluster.start("d", c, *WIDE, "--step-time", "0.5")
    cluster.wait(lambda: any(r.get("event") == "entered" for r in d.records()) and d.digests(),
                 "d to enter")  # fmt: skip
    first = min(d.digests())
    members = [a, b, c, d]
    cluster.wait(lambda: all(world(m, 4, first + 5) for m in members), "four to train")
    pulled = next(r for r in d.records() if r.get("event") == "snapshot_pulled")
    entered = next(r for r in d.records() if r.get("event") == "entered")
    s0, s_enter = pulled["step"], entered["step"]
    spoiled = {r["step"] for r in c.records() if "poisoned" in r}
    assert len(spoiled) == 1 and all(s0 <= k < s_enter for k in spoiled), (s0, s_enter, spoiled)
    for m in (a, b, c):
        assert {e["step"] for e in _events(m)} == spoiled, (m.id, _events(m))
    replayed = _events(d)
    assert [e["step"] for e in replayed] == sorted(spoiled), replayed
    assert all(e["replayed"] and e["action"] == "skipped" for e in replayed)
    assert "c" in replayed[0]["devices"], replayed  # c, a member of the snapshot's policy
    # the replay was exact: at entry d pulled only what the replay does not reproduce (the
    # runtime record), not the parameters or the optimizer state (a NaN applied would have
    # made them all differ)
    assert entered["replayed"] > 0 and entered["pulled_bytes"] < 0.25 * entered["state_bytes"]
    assert assert_equal_from(members, first) >= 5
    assert all(r["finite"] for m in members for r in m.records() if "digest" in r)
